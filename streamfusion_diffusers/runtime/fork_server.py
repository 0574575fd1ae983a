"""The process a job's local ranks fork from: multiprocessing's fork server, which imports torch, diffusers and the
package once (PRELOAD), so that a rank is ready at once instead of importing them all again, each of the ranks at
the same time. It never runs a kernel, so its children start clean, and it ends with the process that started it.

A command starts it before its own imports (`start_early`, from the `streamfusion` entry point), so that the
server's imports, the longest part of a job's start-up, run beside the command's own instead of after them. This
module imports nothing heavy for that reason; nor does the package's __init__.

CUDA starts in a forked child only if the server never started it: the server asks torch whether CUDA is there
through NVML (PYTORCH_NVML_BASED_CUDA_CHECK; torch's default check starts the CUDA driver), and a rank that finds
CUDA started before it says so (rank.py). A rank takes the environment of the process that starts its pool, as
it is then, not the server's (rank.py's `parent_info`): a variable a command sets after the server started still
reaches it."""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

# what a rank's build (build.py's `prepare`) imports: diffusers (an extra: imported only to run) and transformers
# through it, and ours on them
PIPELINE_MODULES = ("diffusers.utils.logging", "streamfusion_diffusers.diffusers.compiled",
                    "streamfusion_diffusers.diffusers.parallel_pipeline", "streamfusion_diffusers.diffusers.stack.apply",
                    "streamfusion_diffusers.models.build", "streamfusion_diffusers.models.full")
# what the server imports, in this order, when it starts (a module that is not installed is skipped); preload
# first: it applies the quiet the command asked for before the libraries it silences are imported
PRELOAD = ("streamfusion_diffusers.runtime.preload", "streamfusion_diffusers.runtime.rank",
           "streamfusion_diffusers.runtime.worker", *PIPELINE_MODULES)
COMMANDS = ("generate", "serve")  # the commands whose ranks a local pool starts


def context() -> BaseContext:
    """The start method of a pool's ranks: forked from this process's fork server (started by the first rank's
    start if `start_early` did not start it)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # read by the server when it starts
    server = multiprocessing.get_context("forkserver")
    server.set_forkserver_preload(list(PRELOAD))
    return server


def start_early(argv: list[str]) -> None:
    """Start the fork server now if this command line runs local ranks (`streamfusion generate|serve`, not under
    a launcher, not --help), with the quiet the command will ask for (`-v` keeps every library's messages)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command not in COMMANDS or "RANK" in os.environ or {"-h", "--help", "--version"} & set(argv):
        return
    if not {"-v", "--verbose"} & set(argv):
        from ..core.logs import quiet_third_party

        quiet_third_party(False)
    context()
    forkserver.ensure_running()


@atexit.register
def _stop() -> None:
    """End this process's fork server (if it started one) as this process ends: left to itself it outlives it by
    its imports, if it is still making them, and by its own interpreter's teardown."""
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)  # (multiprocessing's own)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


__all__ = ["PIPELINE_MODULES", "PRELOAD", "context", "start_early"]

"""The watchdog of a transport's GPU transfers (watch.py labels and bounds them): a host thread that watches CUDA
events against deadlines and, past one, names the transfer and ends the process before torch's NCCL watchdog
speaks with no names; and, for a deadline that expired elsewhere (commands/timing.py), `waiting_line()`: the
oldest transfer any live watchdog still waits for."""
from __future__ import annotations

import collections
import ctypes
import faulthandler
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import NoReturn

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

What = object  # what a wait is for, as its message prints it (watch.py's Label, or a plain string)

EXIT_CODE = 70  # what a process ended by the watchdog exits with (EX_SOFTWARE, as NVSHMEM's start-up watchdog)
GPU_MARGIN = 0.9  # the watchdog thread fires at this share of timeout_s, before torch's NCCL watchdog does

# every live Watchdog, held weakly (a context's transport owns its own): what `waiting_line` looks at
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog:
    """A host thread that watches CUDA events against deadlines; past one, it ends the process. The thread runs
    while events are pending (it ends once it found none for `idle_s`, and the next `watch` starts another).
    It also knows the transfer the host is blocked on right now (`waiting`: gloo waits block the host)."""

    def __init__(self, poll_s: float = 0.2, idle_s: float = 5.0):
        self.poll_s, self.idle_s = poll_s, idle_s
        self.waiting: tuple[float, What] | None = None  # (since, what) of a wait blocking the host
        _LIVE.add(self)
        # (posted, timeout_s, event, what), oldest first
        self._pending: collections.deque[tuple[float, float, torch.cuda.Event, What]] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.last_done: What | None = None  # the latest watched transfer seen complete: where a stuck GPU got to

    def watch(self, event: torch.cuda.Event, what: What, posted: float, timeout_s: float) -> None:
        with self._lock:
            self._pending.append((posted, timeout_s, event, what))
            if self._thread is None:
                self._closed.clear()
                self._thread = threading.Thread(target=self._run, name="streamfusion-watchdog", daemon=True)
                self._thread.start()

    def watch_stream(self, what: What, timeout_s: float, posted: float | None = None,
                     stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """Watch the work queued so far on `stream` (default: the current CUDA stream; not while a CUDA graph is
        being captured)."""
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event()
        event.record(stream)
        self.watch(event, what, time.monotonic() if posted is None else posted, timeout_s)
        return event

    def oldest(self) -> tuple[float, float, What] | None:
        """(posted, timeout_s, what) of the oldest watched transfer not yet complete; forgets completed ones."""
        with self._lock:
            while self._pending and self._pending[0][2].query():
                self.last_done = self._pending.popleft()[3]
            return None if not self._pending else (self._pending[0][0], self._pending[0][1], self._pending[0][3])

    def last_seen(self) -> tuple[float, What, int] | None:
        """(posted, what, how many are pending) of the oldest watched transfer not yet seen complete, as of the
        thread's last look: read without the lock or a CUDA call, either of which can block behind a full launch
        queue (a host that queued seconds of work), where a deadline that expired elsewhere must still say what was
        waited for."""
        try:
            posted, _, _, what = self._pending[0]
        except IndexError:
            return None
        return posted, what, len(self._pending)

    def close(self) -> None:
        """Stop watching: forget what is pending and end the thread."""
        with self._lock:
            self._pending.clear()
            thread, self._thread = self._thread, None
            self._closed.set()
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        busy = time.monotonic()  # when something was last pending
        while not self._closed.wait(self.poll_s):
            oldest = self.oldest()
            if oldest is not None and time.monotonic() - oldest[0] > GPU_MARGIN * oldest[1]:
                logging.shutdown()
                report_and_exit(f"{late(oldest[2], oldest[1])}; ending this process (exit code {EXIT_CODE})")
            with self._lock:
                if self._pending:
                    busy = time.monotonic()
                elif time.monotonic() - busy > self.idle_s and self._thread is threading.current_thread():
                    self._thread = None  # nothing to watch for a while: end; the next watch starts a thread again
                    return


def waiting_line() -> str:
    """The oldest transfer a live watchdog waits for (blocking the host, or pending on the GPU as its thread last
    saw), as one line; it makes no CUDA call and takes no lock, so it is said even where those would block."""
    found = []
    for dog in list(_LIVE):
        if dog.waiting is not None:
            found.append((dog.waiting[0], "the host waits for", dog.waiting[1], ""))
        if (seen := dog.last_seen()) is not None:
            after = f" (the last seen complete: {dog.last_done})" if dog.last_done is not None else ""
            behind = f"; {seen[2] - 1} more pending behind it" if seen[2] > 1 else ""
            found.append((seen[0], "the GPU waits for", seen[1], f"{after}{behind}"))
    if not found:
        return "no attention transfer was pending (the wait is elsewhere: see the stacks)"
    since, how, what, more = min(found, key=lambda f: f[0])
    return f"{how} {what}, posted {time.monotonic() - since:.1f} s ago{more}"


def this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def report_and_exit(head: str) -> NoReturn:
    """Write `head` and every thread's stack as one block, each line marked with this rank, then end the process
    with EXIT_CODE: the ranks of a job share one stderr, and stacks written line by line at once interleave past
    reading. Where py-spy is on PATH, its native stacks follow in a second block (which thread holds the GIL, where
    each waits in C): written after the first, which a peer's exit must not cut off."""
    rank = this_rank()
    with tempfile.TemporaryFile() as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)  # needs a file descriptor
        dump.seek(0)
        stacks = dump.read().decode(errors="replace").splitlines()
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), _marked(rank, stacks, head))
    if native := _native_stacks():
        os.write(sys.stderr.fileno(), _marked(rank, native))
    os._exit(EXIT_CODE)


def _marked(rank: int, lines: list[str], head: str = "") -> bytes:
    marked = (f"rank {rank}| {line}\n" for line in lines if line.strip())
    return "".join([f"{head}\n" if head else "", *marked]).encode()


def _native_stacks() -> list[str]:
    """py-spy's dump of this process (native frames, GIL holder), or nothing where py-spy is not installed."""
    spy = shutil.which("py-spy")
    if spy is None:
        return []
    try:  # let a child trace this process where Yama allows only ancestors (PR_SET_PTRACER, PR_SET_PTRACER_ANY)
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)
        done = subprocess.run([spy, "dump", "--native", "--pid", str(os.getpid())], capture_output=True, text=True,
                              timeout=30)
        return ["py-spy dump --native:", *(done.stdout + done.stderr).splitlines()]
    except (OSError, subprocess.TimeoutExpired) as err:
        return [f"py-spy dump failed: {err}"]


def late(what: What, timeout_s: float) -> str:
    return (f"streamfusion: {what} did not complete within {timeout_s:.0f} s (ParallelConfig.timeout_s): a peer "
            f"died, stalled or runs a different layer (see its log); raise timeout_s if a layer legitimately "
            f"takes longer")


__all__ = ["EXIT_CODE", "Watchdog", "late", "report_and_exit", "this_rank", "waiting_line"]

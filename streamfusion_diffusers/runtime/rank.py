"""What runs in a pool's rank process: join the group's process group, then run the functions the parent sends,
one call at a time, until it sends None.

The same loop serves a pool spawned on this machine (pool.py) and a rank of a job across machines, spawned by
its node's launched process (host.py): only how the rank joins its process group differs (`join`). While a
function runs, the rank may `note` its progress, and read whether the parent asked the call to stop
(`cancelled`). A rank whose parent dies exits too.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from ..context import shutdown
from ..core.logs import quiet_noisy_loggers
from . import startup

_OUTBOX: mp.Queue | None = None  # in a rank process: where `note` sends (the pool's outbox, set at start)
_CANCEL: Any = None  # in a rank process: the pool's cancel value (the number of the call to stop)
_CALL = 0  # in a rank process: the number of the call it runs
LEAVING = "streamfusion_leaving"  # the store's count of the ranks leaving a job that is over


def exit_with(owner: int) -> None:
    """Exit this process when `owner` is gone (killed before it could stop its children): the process that started
    it, or whose fork server did (which lives on while its children do)."""
    while _alive(owner):
        time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: not Linux
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class _Stdio:
    """This process's stdout and stderr, for a rank to write to (a rank forked from a fork server would otherwise
    write where the server's went when it started): pickled as duplicates of the descriptors, adopted where it is
    unpickled, in the rank before its function runs."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return _adopt_stdio, (DupFd(1), DupFd(2))


def _adopt_stdio(out: Any, err: Any) -> None:
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def note(value: Any) -> None:
    """Tell the parent how a running function is getting on (e.g. steps done); the pool keeps the latest
    note as `last_note`. Outside a pool's rank it does nothing."""
    if _OUTBOX is not None:
        _OUTBOX.put((int(os.environ["RANK"]), None, value))


def cancelled() -> bool:
    """Whether the parent asked the call this rank runs to stop (ranks may read it at different moments: they
    agree on it with a collective before stopping). Outside a pool's rank: never."""
    return _CANCEL is not None and _CANCEL.value == _CALL


def serve_rank(rank: int, join: Callable[[], None], parent: tuple, inbox: mp.Queue, outbox: mp.Queue, cancel: Any,
               ahead: Callable[[], None] | None = None) -> None:
    """The rank process: `join` its process group (it sets RANK), say so, then run each (call, fn, args, kwargs)
    the parent sends and answer (rank, ok, result or traceback). `ahead`: started before the join, what may run
    beside it (a job's pool imports its pipeline's modules: runtime/build.py's `import_ahead`)."""
    global _OUTBOX, _CANCEL, _CALL
    owner, environ, log_level, warning_filters, asked_at, _ = parent  # (its stdio adopted as it was unpickled)
    startup.asked(asked_at)
    os.environ.clear()  # the parent's as it is now (a fork server's children would have the server's, from its start)
    os.environ.update(environ)
    startup.mark("imported")
    if ahead is not None:
        ahead()
    _OUTBOX, _CANCEL = outbox, cancel
    threading.Thread(target=exit_with, args=(owner,), daemon=True).start()
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s: %(message)s")  # says what the parent says
    warnings.filters[:] = warning_filters
    if os.environ.get("STREAMFUSION_QUIET"):
        quiet_noisy_loggers()
    # tqdm's default lock is a multiprocessing RLock: a named semaphore that the parent's resource tracker counts
    # until the rank releases it, which a rank the pool stops by force never does (the parent's exit then warns of
    # "leaked semaphore objects"). A rank's bars are its own process's: a thread lock is all they need.
    tqdm.set_lock(threading.RLock())
    try:
        join()
    except Exception:  # noqa: BLE001 - report start-up failures to the parent instead of hanging it
        outbox.put((rank, False, traceback.format_exc()))
        return
    startup.mark("joined")
    outbox.put((rank, True, None))
    while (task := inbox.get()) is not None:
        _CALL, fn, args, kwargs = task
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except Exception:  # noqa: BLE001
            outbox.put((rank, False, traceback.format_exc()))
    # the job is over: meet the peers, then end the process without tearing down what its end releases anyway
    # (the NCCL communicators, whose destruction can wait on every peer's, the CUDA context, every module), which
    # the parent, waiting for its ranks to exit, would wait for
    shutdown(destroy=False)
    leave(outbox)


def leave(outbox: mp.Queue, wait_s: float = 5.0) -> None:
    """End this rank's process at once, what it said flushed. The rank whose process hosts the job's store
    (rank 0 of a local pool) goes last, once every peer has said it is leaving (at most `wait_s`): a peer still
    alive would find the store gone and log the loss."""
    store = _store()
    if store is not None:
        try:
            if dist.get_rank() != 0:
                store.add(LEAVING, 1)
            else:
                ends = time.monotonic() + wait_s
                while store.add(LEAVING, 0) < dist.get_world_size() - 1 and time.monotonic() < ends:
                    time.sleep(0.01)
                time.sleep(0.05)  # from a peer's word to its exit
        except Exception:  # noqa: BLE001 - a peer already gone took the store with it: nothing left to order
            pass
    outbox.close()
    outbox.join_thread()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _store() -> Any:
    """The default process group's store, where one is up (None otherwise)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def parent_info() -> tuple:
    """What a rank takes from the process that starts it: its pid (the rank exits when it is gone), its environment,
    its log level and warning filters, when it asked for the rank, and its stdout and stderr."""
    return (os.getpid(), dict(os.environ), logging.getLogger().getEffectiveLevel(), list(warnings.filters),
            time.time(), _Stdio())


__all__ = ["cancelled", "exit_with", "note", "parent_info", "serve_rank"]

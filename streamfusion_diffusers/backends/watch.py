"""Bounded, named waits: a transfer that cannot complete says which layer, stage and peer it was waiting for.

`WatchedTransport` wraps any transport (outermost): every transfer is labelled when it is posted with the
layer number, the schedule's stage (`stage("pull_kv")` set by the Torus schedule; the group names the rest:
ulysses all-to-all, ring pass, joint all-gather) and the peers it waits for, and its wait is bounded by
timeout_s in the way the device allows:
- on the CPU (gloo) the wait blocks and the process group's timeout (ParallelConfig.timeout_s, given to every
  group the mesh creates) ends it; the error it raises is re-raised as `TransferFailed` naming the transfer;
- on GPUs (NCCL, NVSHMEM) waits only order streams and the host never blocks, so a CUDA event recorded after
  each wait is watched. The host may run at most RUN_AHEAD layers ahead of the GPU: `begin_layer` polls the
  oldest layer's end and raises `TransferFailed` naming the oldest transfer still pending once it is late
  (80 % of timeout_s after it was posted). This also keeps the CUDA queue from filling, where a launch would
  block holding the GIL (nvshmem4py's on-stream calls do). Where the host is stuck in a CUDA call instead (a
  synchronize), a watchdog thread logs the same error at 90 % of timeout_s, before torch's NCCL watchdog
  speaks with no names, and ends the process as torch's would: the stream it waits on can never drain.
The watchdog belongs to its WatchedTransport (so to its ParallelContext): its thread runs while transfers are
pending and a little after (a generation's layers post one after another: one thread for all, none started per
layer), and `close()` (from shutdown()) stops it. `waiting_line()` names, for a deadline that expired
elsewhere (commands/timing.py), the oldest transfer any live watchdog still waits for.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import faulthandler
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..core.mesh import Group
from .base import Handle, Transport

logger = logging.getLogger(__name__)

EXIT_CODE = 70  # what a process ended by the watchdog exits with (EX_SOFTWARE, as NVSHMEM's start-up watchdog)
GPU_MARGIN = 0.9  # the watchdog thread fires at this share of timeout_s, before torch's NCCL watchdog does
HOST_MARGIN = 0.8  # begin_layer raises at this share, before the watchdog thread ends the process
RUN_AHEAD = 4  # attention layers the host may queue ahead of the GPU
POLL_S = 2e-4
_KINDS = {"ulysses_intra": "ulysses all-to-all", "ring": "ring pass", "torus": "torus transfer",
          "world": "joint all-gather"}
_stage: contextvars.ContextVar[str] = contextvars.ContextVar("streamfusion_stage", default="")


class TransferFailed(RuntimeError):
    """A transfer of an attention layer failed or timed out; the message names the layer, stage and peers."""


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Label the transfers posted inside with a schedule stage (pull_q, pull_kv, push_o); "" for none."""
    token = _stage.set(name)
    try:
        yield
    finally:
        _stage.reset(token)


def _who(group: Group, peers: Sequence[int]) -> str:
    ranks = sorted({group.ranks[p] for p in peers})  # peers are positions in the group; name global ranks
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}" if ranks else "no peer"


def describe(layer: int, group: Group, peers: Sequence[int], direction: str = "with",
             sent_to: Sequence[int] = (), stage_name: str = "") -> str:
    """'attention layer 12, pull_kv torus transfer from rank 3' (and ', sending to rank 1' when it differs)."""
    kind = _KINDS.get(group.name, f"{group.name} transfer")
    where = f"{stage_name} {kind}".strip()
    also = f", sending to {_who(group, sent_to)}" if set(sent_to) - set(peers) else ""
    return f"attention layer {layer}, {where} {direction} {_who(group, peers)}{also}"


class Label:
    """A transfer's name, written only when a message needs it: labelling runs for every transfer of every
    layer, and formatting each eagerly costs microseconds a small layer cannot spare."""

    __slots__ = ("args",)

    def __init__(self, layer: int, group: Group, peers: Sequence[int] | None = None, direction: str = "with",
                 sent_to: Sequence[int] = ()):
        self.args = (layer, group, peers, direction, sent_to, _stage.get())

    def __str__(self) -> str:
        layer, group, peers, direction, sent_to, stage_name = self.args
        if peers is None:  # every other member of the group
            peers = [p for p in range(group.size) if p != group.index]
        return describe(layer, group, peers, direction, sent_to, stage_name)


def _failed(what: Label | str, err: BaseException) -> TransferFailed:
    return TransferFailed(f"streamfusion: {what} failed: {type(err).__name__}: {err}. A peer died, stalled or ran "
                          f"a different layer (see its log); ParallelConfig.timeout_s bounds every wait")


# every live Watchdog, held weakly (a context's transport owns its own): what `waiting_line` looks at
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog:
    """A host thread that watches CUDA events against deadlines; past one, it ends the process. The thread runs
    while events are pending (it ends once it found none for `idle_s`, and the next `watch` starts another).
    It also knows the transfer the host is blocked on right now (`waiting`: gloo waits block the host)."""

    def __init__(self, poll_s: float = 0.2, idle_s: float = 5.0):
        self.poll_s, self.idle_s = poll_s, idle_s
        self.waiting: tuple[float, Label | str] | None = None  # (since, what) of a wait blocking the host
        _LIVE.add(self)
        # (posted, timeout_s, event, what), oldest first
        self._pending: collections.deque[tuple[float, float, torch.cuda.Event, Label | str]] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, event: torch.cuda.Event, what: Label | str, posted: float, timeout_s: float) -> None:
        with self._lock:
            self._pending.append((posted, timeout_s, event, what))
            if self._thread is None:
                self._closed.clear()
                self._thread = threading.Thread(target=self._run, name="streamfusion-watchdog", daemon=True)
                self._thread.start()

    def watch_stream(self, what: Label | str, timeout_s: float, posted: float | None = None,
                     stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
        """Watch the work queued so far on `stream` (default: the current CUDA stream; not while a CUDA graph is
        being captured)."""
        if torch.cuda.is_current_stream_capturing():
            return None
        event = torch.cuda.Event()
        event.record(stream)
        self.watch(event, what, time.monotonic() if posted is None else posted, timeout_s)
        return event

    def oldest(self) -> tuple[float, float, Label | str] | None:
        """(posted, timeout_s, what) of the oldest watched transfer not yet complete; forgets completed ones."""
        with self._lock:
            while self._pending and self._pending[0][2].query():
                self._pending.popleft()
            return None if not self._pending else (self._pending[0][0], self._pending[0][1], self._pending[0][3])

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
            late = self.oldest()
            if late is not None and time.monotonic() - late[0] > GPU_MARGIN * late[1]:
                logger.critical("%s; ending this process (exit code %d)", _late(late[2], late[1]), EXIT_CODE)
                logging.shutdown()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                os._exit(EXIT_CODE)
            with self._lock:
                if self._pending:
                    busy = time.monotonic()
                elif time.monotonic() - busy > self.idle_s and self._thread is threading.current_thread():
                    self._thread = None  # nothing to watch for a while: end; the next watch starts a thread again
                    return


def waiting_line() -> str:
    """The oldest transfer a live watchdog waits for (blocking the host, or pending on the GPU), as one line."""
    found = []
    for dog in list(_LIVE):
        if dog.waiting is not None:
            found.append((dog.waiting[0], "the host waits for", dog.waiting[1]))
        oldest = dog.oldest()
        if oldest is not None:
            found.append((oldest[0], "the GPU waits for", oldest[2]))
    if not found:
        return "no attention transfer was pending (the wait is elsewhere: see the stacks)"
    since, how, what = min(found, key=lambda f: f[0])
    return f"{how} {what}, posted {time.monotonic() - since:.1f} s ago"


def _late(what: Label | str, timeout_s: float) -> str:
    return (f"streamfusion: {what} did not complete within {timeout_s:.0f} s (ParallelConfig.timeout_s): a peer "
            f"died, stalled or runs a different layer (see its log); raise timeout_s if a layer legitimately "
            f"takes longer")


class Watched:
    """A Handle whose wait names its transfer when it fails and, on a GPU, is watched until it completes."""

    def __init__(self, inner: Handle, what: Label, owner: WatchedTransport, on_gpu: bool):
        self.inner, self.what, self.owner, self.on_gpu = inner, what, owner, on_gpu
        self.posted = time.monotonic()

    def wait(self) -> None:
        watchdog = self.owner.watchdog
        watchdog.waiting = (self.posted, self.what)
        try:
            self.inner.wait()
        except Exception as err:  # noqa: BLE001 - gloo / NCCL raise RuntimeError subclasses of their own
            raise _failed(self.what, err) from err
        finally:
            watchdog.waiting = None
        if self.on_gpu:  # a GPU transfer
            watchdog.watch_stream(self.what, self.owner.timeout_s, self.posted, self.owner.stream())


class WatchedTransport:
    """`inner` with every transfer labelled (layer, stage, peers) and its wait bounded by timeout_s."""

    def __init__(self, inner: Transport, timeout_s: float):
        self.inner, self.timeout_s = inner, timeout_s
        self.name = inner.name
        self.layer = 0
        self._on_gpu = False  # this layer moved CUDA tensors
        self._ends: collections.deque[torch.cuda.Event] = collections.deque()  # GPU: each layer's end, in order
        self._stream: torch.cuda.Stream | None = None  # this layer's CUDA stream, once read
        self._device = 0  # the CUDA device of the last GPU transfer
        self.watchdog = Watchdog()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # mailbox and other transport-specific state

    def begin_layer(self, peer_bytes: int) -> None:
        self.layer += 1
        self._stream = None
        while len(self._ends) >= RUN_AHEAD and not torch.cuda.is_current_stream_capturing():
            self._drain(self._ends.popleft())  # (only GPU layers fill _ends; no host waits inside a capture)
        self.inner.begin_layer(peer_bytes)

    def end_layer(self) -> None:
        self.inner.end_layer()
        if self._on_gpu:
            self._on_gpu = False
            extra = " (BARRIERALL, signals nobody waited on)" if self.name.startswith("nvshmem") else ""
            end = self.watchdog.watch_stream(f"attention layer {self.layer}, end of layer{extra}", self.timeout_s,
                                             stream=self.stream())
            if end is not None:
                self._ends.append(end)
        self._stream = None

    def stream(self) -> torch.cuda.Stream:
        """The CUDA stream this layer's waits are ordered on, read once per layer: torch's lookup of the current
        stream is a long chain of Python calls, which every watched wait would pay."""
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self._device)  # (by index: the current device's is a longer way)
        return self._stream

    def _drain(self, end: torch.cuda.Event) -> None:
        """Wait (polling, the GIL free) until the GPU finished a layer; raise naming what is late."""
        while not end.query():
            late = self.watchdog.oldest()
            if late is not None and time.monotonic() - late[0] > HOST_MARGIN * late[1]:
                raise TransferFailed(_late(late[2], late[1]))
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the watchdog (shutdown() calls it): nothing this transport posted is watched any more."""
        self.watchdog.close()
        self._ends.clear()

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        return self.inner.recv_buffer(like, shape, peer, group)

    def _post(self, what: Label, like: Tensor | None, post: Callable[..., Handle], *args: object) -> Handle:
        try:
            handle = post(*args)
        except (ValueError, MemoryError):
            raise  # our own refusals (a bad call, an exhausted mailbox) say what to fix already
        except Exception as err:  # noqa: BLE001
            raise _failed(what, err) from err
        on_gpu = like is not None and like.is_cuda
        if on_gpu:
            self._on_gpu, self._device = True, like.device.index
        return Watched(handle, what, self, on_gpu)

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        got, sent = [p for _, p in recvs], [p for _, p in sends]
        what = Label(self.layer, group, got, "from", sent) if got else Label(self.layer, group, sent, "to")
        like = recvs[0][0] if recvs else sends[0][0] if sends else None
        return self._post(what, like, self.inner.exchange, sends, recvs, group)

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        like = None
        for pieces in recvs:
            if pieces:
                like = pieces[0]
                break
        return self._post(Label(self.layer, group), like, self.inner.all_to_all, sends, recvs, group)

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        return self._post(Label(self.layer, group), output, self.inner.all_gather, output, input, group)

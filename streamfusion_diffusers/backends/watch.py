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
layer), and `close()` (from shutdown()) stops it. The watchdog itself, and `waiting_line()` for a deadline that
expired elsewhere, are in watchdog.py.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..core.mesh import Group
from .base import Handle, Transport
from .watchdog import Watchdog, late

logger = logging.getLogger(__name__)

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
        self.name, self.kind = inner.name, inner.kind
        self.staging = inner.staging  # Ulysses asks at every exchange: bound once, not looked up through __getattr__
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
            oldest = self.watchdog.oldest()
            if oldest is not None and time.monotonic() - oldest[0] > HOST_MARGIN * oldest[1]:
                raise TransferFailed(late(oldest[2], oldest[1]))
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

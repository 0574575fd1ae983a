"""CUDA-graph capture of a whole parallelized transformer forward, replayed every step (issue 11; DynaFlow's
"the schedule as data"): one forward of Flux.1-dev launches thousands of kernels and collectives whose shapes
depend only on the input shapes, so the host-side cost of a step (Python, launches, schedule bookkeeping)
is paid once per shape and then replaced by one `graph.replay()`.

`capture(call)` is the one recipe (warm-up on a side stream, then `torch.cuda.graph`); `GraphedForward` is a
diffusers hook, outermost on the transformer, that captures the forward once per input signature (tensor
shapes, dtypes and devices plus every non-tensor argument) into static input buffers, and on later calls
copies the inputs in, replays, and returns a copy of the static outputs (the next replay overwrites them).

Transports: NCCL collectives are capturable once their communicators exist (the warm-up creates them).
NVSHMEM is replay-safe as built: mailbox offsets restart at zero every layer (host counters, so the captured
addresses are the same each replay), each message's signal is SET to 1 (not incremented) and waited on as
>= 1, every signal is zeroed at the layer's end, and the next layer's BARRIERALL fences the zeroing from the
peers' next puts. The one thing a replay cannot follow is the mailbox moving: when a larger shape makes it
grow, the symmetric buffer is reallocated, so every graph records the mailbox it captured against and is
captured again when that changed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ..context import ParallelContext

logger = logging.getLogger(__name__)

GRAPH_HOOK = "streamfusion_cuda_graph"
WARMUP = 2  # eager runs on the side stream before capture: communicators, cuDNN plans and the allocator settle
NO_GPU = "cuda_graph needs a GPU (an NCCL process group and a CUDA model); drop --cuda-graph / cuda_graph=True"


def check_graphable(ctx: ParallelContext) -> None:
    """Refuse where CUDA graphs cannot run: no GPU, or a gloo (CPU) process group."""
    if not torch.cuda.is_available() or dist.get_backend() != "nccl":
        raise ValueError(NO_GPU)


def capture(call: Callable[[], Any], warmup: int = WARMUP) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `call` up on a side stream, then capture it; returns the graph and the output of the captured call
    (static tensors that every replay rewrites). Every rank must capture the same calls in the same order."""
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    compute.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread's event queries must not invalidate this thread's capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = call()
    torch.cuda.synchronize()
    return graph, out


def transport_epoch(ctx: ParallelContext) -> tuple[int, int] | None:
    """What a captured graph's addresses depend on beyond the inputs: the NVSHMEM mailbox (address, size)."""
    mailbox = getattr(ctx.transport, "mailbox", None)
    if mailbox is None or mailbox.data is None:
        return None
    return mailbox.data.data_ptr(), mailbox.capacity


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]  # static buffers, in the order of the call's tensor leaves
    output: Any
    epoch: tuple[int, int] | None


def _signature(leaves: list[Any]) -> tuple:
    """The part of a call a graph is specific to: tensor shapes, dtypes, devices, and every other value."""
    key = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
        else:
            key.append(leaf if isinstance(leaf, (int, float, bool, str, type(None))) else repr(leaf))
    return tuple(key)


class GraphedForward(ModelHook):
    """Replays the transformer forward (with the sharding hooks inside it) from CUDA graphs, one per shape."""

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.graphs: dict[tuple, _Captured] = {}

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = (spec, _signature(leaves))
        captured = self.graphs.get(key)
        if captured is not None and captured.epoch != transport_epoch(self.ctx):
            del self.graphs[key]  # the NVSHMEM mailbox moved (a larger shape made it grow): capture again
            captured = None
        if captured is None:
            captured = self.graphs[key] = self._capture(leaves, spec)
        for static, value in zip(captured.inputs, (x for x in leaves if isinstance(x, Tensor))):
            static.copy_(value)
        captured.graph.replay()
        self.ctx.transport.watchdog.watch_stream("the CUDA graph replay of the transformer forward",
                                                 self.ctx.config.timeout_s)  # bounded
        return tree_map_only(Tensor, torch.clone, captured.output)

    def _capture(self, leaves: list[Any], spec: Any) -> _Captured:
        forward = self.fn_ref.original_forward  # the sharding hooks and the transformer's own forward
        static = [x.clone() if isinstance(x, Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(static, spec)
        if self.ctx.global_rank == 0:
            logger.info("streamfusion: capturing the transformer forward in a CUDA graph (%d-th shape)",
                        len(self.graphs) + 1)
        graph, output = capture(lambda: forward(*args, **kwargs))
        return _Captured(graph, [x for x in static if isinstance(x, Tensor)], output, transport_epoch(self.ctx))


__all__ = ["GRAPH_HOOK", "GraphedForward", "capture", "check_graphable", "transport_epoch"]

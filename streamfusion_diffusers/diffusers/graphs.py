"""CUDA-graph capture of a whole parallelized transformer forward, replayed every step (DynaFlow's "the schedule
as data"): one forward of Flux.1-dev launches thousands of kernels and collectives whose shapes depend only on
the input shapes, so the host-side cost of a step (Python, launches, schedule bookkeeping) is paid once per
shape and then replaced by one `graph.replay()`.

`capture(call)` is the one recipe (warm-up on a side stream, then `torch.cuda.graph`); `GraphedForward` is a
diffusers hook, outermost on the transformer, that runs the first call of each input signature (tensor shapes,
dtypes and devices plus every non-tensor argument) eager (it makes the communicators, the kernel choices and
the layout, and a generation of one step never pays for a capture), captures the second into static input
buffers, and on later calls copies the inputs in, replays, and returns a copy of the static outputs (the next
replay overwrites them). The graphs of a hook are a cache bounded in bytes: past its budget the least recently
replayed graph is freed with its memory pool (a server that sees many sizes keeps the ones it uses).

A graph also replays whatever the host decided while it was captured: which LoRA adapters run and the scaling
floats they multiply by (peft reads both on the host). A caller that changes them between calls says so with
`set_variant` (the adapters and weights on now), and each variant gets graphs of its own, keyed like a shape.

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
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from ..context import ParallelContext

logger = logging.getLogger(__name__)

GRAPH_HOOK = "streamfusion_cuda_graph"
WARMUP = 1  # eager runs on the side stream before capture (after the first call's eager run on the compute
# stream): cuBLAS workspaces, cuDNN plans and the allocator settle
BUDGET_SHARE = 0.5  # the graphs' default budget: this share of the GPU memory free at the first capture
MIN_REPLAYS = 2  # a capture (one eager warm-up and the capture itself, about two forwards) pays only when at least
# this many replays follow the one that captured
NOT_CAPTURED = ("the transformer forward could not be captured in a CUDA graph (compiled blocks can tune a kernel "
                "there, which a capture forbids): run it eager with --no-cuda-graph (parallelize(..., "
                "cuda_graph=False)), or drop --compile; what broke the capture")
NO_GPU = "cuda_graph needs a GPU (an NCCL process group and a CUDA model); drop --cuda-graph / cuda_graph=True"


def check_graphable(ctx: ParallelContext) -> None:
    """Refuse where CUDA graphs cannot run: no GPU, or a gloo (CPU) process group."""
    if not torch.cuda.is_available() or dist.get_backend() != "nccl":
        raise ValueError(NO_GPU)


def capture(call: Callable[[], Any], warmup: int = WARMUP) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm `call` up on a side stream, then capture it on the same stream; returns the graph and the output of
    the captured call (static tensors that every replay rewrites). Every rank must capture the same calls in the
    same order. One stream for both: compiled code that read the current stream is guarded on it, and on another
    stream it would be compiled again inside the capture, whose kernels' first launch tunes them, which a capture
    forbids."""
    compute = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    compute.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the NCCL watchdog thread's event queries must not invalidate this thread's capture
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            out = call()
    except RuntimeError as err:  # the capture's own error is the second; what broke it is the first
        raise RuntimeError(f"{NOT_CAPTURED}: {first_line(err.__context__ or err)}") from err
    torch.cuda.synchronize()
    return graph, out


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


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
    bytes: int  # GPU memory the capture reserved (its pool and static tensors)


@dataclass
class GraphStats:
    """What the graphs did (run.json's `cuda_graph`): calls run eager (the first of each shape), captures and
    their seconds, replays, graphs freed for the budget, and the bytes held now."""

    eager_calls: int = 0
    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    evicted: int = 0
    held_bytes: int = 0
    budget_bytes: int | None = None
    seen: set = field(default_factory=set, repr=False)  # signatures run once eager

    def record(self) -> dict[str, Any]:
        return {"eager_calls": self.eager_calls, "captures": self.captures, "capture_s": self.capture_s,
                "replays": self.replays, "evicted": self.evicted, "held_gib": self.held_bytes / 2**30,
                "budget_gib": None if self.budget_bytes is None else self.budget_bytes / 2**30}


def _signature(leaves: list[Any]) -> tuple:
    """The part of a call a graph is specific to: tensor shapes, dtypes, devices, and every other value."""
    key = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.stride()))
        else:
            key.append(leaf if isinstance(leaf, (int, float, bool, str, type(None))) else repr(leaf))
    return tuple(key)


def graph_hooks(target: Any) -> list[GraphedForward]:
    """The graph hooks of a pipeline's transformers, or of a transformer (none where graphs are off)."""
    found = []
    transformers = [getattr(target, name, None) for name in ("transformer", "transformer_2")]
    for transformer in transformers if transformers[0] is not None else [target]:  # a pipeline, or a transformer
        registry = getattr(transformer, "_diffusers_hook", None)
        hook = registry.get_hook(GRAPH_HOOK) if registry is not None else None
        if hook is not None:
            found.append(hook)
    return found


def set_horizon(target: Any, calls: int | None) -> None:
    """Tell the graph hooks how many forward calls the coming generation makes (its steps; None: unbounded),
    so that a generation too short to pay for a capture runs eager."""
    for hook in graph_hooks(target):
        hook.horizon = calls


def set_variant(target: Any, variant: Any) -> None:
    """Tell the graph hooks what else the coming calls depend on beyond their inputs (a hashable value: the
    LoRA adapters on and their weights): a graph captured under another variant is never replayed for them."""
    for hook in graph_hooks(target):
        hook.variant = variant


def _agreed(held: int, budget: int, ctx: ParallelContext) -> tuple[int, int]:
    """(the largest `held`, the smallest `budget`) over the ranks that run this forward together."""
    values = torch.tensor([held, -budget], dtype=torch.int64, device="cuda")
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=ctx.pipeline_group.pg)
    return int(values[0]), -int(values[1])


class GraphedForward(ModelHook):
    """Replays the transformer forward (with the sharding hooks inside it) from CUDA graphs, one per shape,
    captured at a shape's second call; at most `budget_bytes` of them held (default: BUDGET_SHARE of the GPU
    memory free at the first capture), the least recently used freed first."""

    def __init__(self, ctx: ParallelContext, budget_bytes: int | None = None):
        super().__init__()
        self.ctx = ctx
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()  # least recently replayed first
        self.stats = GraphStats(budget_bytes=budget_bytes)
        self.horizon: int | None = None  # calls left in this generation (None: unbounded, as a server's)
        self.variant: Any = None  # what the calls depend on beyond their inputs (set_variant), part of each key

    def _pays(self) -> bool:
        """Whether a capture now is followed by enough replays to pay for it."""
        return self.horizon is None or self.horizon - 1 >= MIN_REPLAYS

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._forward(*args, **kwargs)
        finally:
            if self.horizon is not None:
                self.horizon -= 1

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = (spec, _signature(leaves), self.variant, self.ctx.native_now)  # a native step: kernels of its own
        captured = self.graphs.get(key)
        if captured is not None and captured.epoch != transport_epoch(self.ctx):
            self._free(key)  # the NVSHMEM mailbox moved (a larger shape made it grow): capture again
            captured = None
        if captured is None:
            if key not in self.stats.seen or not self._pays():  # a shape's first call runs eager
                self.stats.seen.add(key)
                self.stats.eager_calls += 1
                return self.fn_ref.original_forward(*args, **kwargs)
            captured = self._capture(key, leaves, spec)
        self.graphs.move_to_end(key)
        for static, value in zip(captured.inputs, (x for x in leaves if isinstance(x, Tensor))):
            static.copy_(value)
        captured.graph.replay()
        self.stats.replays += 1
        self.ctx.transport.watchdog.watch_stream("the CUDA graph replay of the transformer forward",
                                                 self.ctx.config.timeout_s)  # bounded
        return tree_map_only(Tensor, torch.clone, captured.output)

    def _capture(self, key: tuple, leaves: list[Any], spec: Any) -> _Captured:
        forward = self.fn_ref.original_forward  # the sharding hooks and the transformer's own forward
        static = [x.clone() if isinstance(x, Tensor) else x for x in leaves]
        args, kwargs = tree_unflatten(static, spec)
        if self.ctx.global_rank == 0:
            logger.info("streamfusion: capturing the transformer forward in a CUDA graph (%d-th shape)",
                        self.stats.captures + 1)
        budget = self.stats.budget_bytes
        if budget is None:
            budget = int(BUDGET_SHARE * torch.cuda.mem_get_info()[0])
        reserved = torch.cuda.memory_reserved()
        started = time.perf_counter()
        graph, output = capture(lambda: forward(*args, **kwargs))
        self.stats.capture_s += time.perf_counter() - started
        self.stats.captures += 1
        # the ranks agree on the bytes and the budget (the largest graph, the smallest budget), so that every
        # rank frees the same graphs: a rank that replayed where its peers captured would deadlock them
        held, budget = _agreed(max(torch.cuda.memory_reserved() - reserved, 0), budget, self.ctx)
        self.stats.budget_bytes = budget
        captured = self.graphs[key] = _Captured(graph, [x for x in static if isinstance(x, Tensor)], output,
                                                transport_epoch(self.ctx), held)
        self.stats.held_bytes += held
        while self.stats.held_bytes > budget and len(self.graphs) > 1:
            self._free(next(iter(self.graphs)))
            self.stats.evicted += 1
        return captured

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        """The hook is removed (unparallelize): its graphs go with it."""
        self.release()
        return module

    def release(self) -> None:
        """Free every graph (the context closes: NCCL's teardown waits for the graphs that captured its calls)."""
        while self.graphs:
            self._free(next(iter(self.graphs)))

    def _free(self, key: tuple) -> None:
        """Free one graph and its memory pool."""
        captured = self.graphs.pop(key)
        self.stats.held_bytes -= captured.bytes
        captured.graph.reset()


__all__ = ["GRAPH_HOOK", "GraphStats", "GraphedForward", "capture", "check_graphable", "graph_hooks", "set_horizon",
           "set_variant", "transport_epoch"]

"""Every rank a share of the weights, gathered in place: `parallelize(..., shard_weights=True)`.

Sequence parallelism splits the tokens and leaves every rank the whole model; sharding splits the weights too,
only as far as memory needs (what streams: weight_split.py). Each unit's parameters are one flat byte buffer
(flat_units.py), of which each rank keeps 1/P; a `dist.all_gather_into_tensor` over the ranks that run every
forward together rebuilds it whole.

Gathered in place: every buffer a gather writes into is allocated once, at setup, and each parameter is a view into
its unit's place in one of them, so no parameter ever moves and a CUDA graph captures the gathers with the forward
(`graphs.py`), and torch.compile sees plain tensors. The streamed (sharded) blocks share two slots (double buffers):
the block about to run is gathered into its slot (or was, by the previous block's prefetch) and the next streamed
block's gather is issued into the other slot as it starts, so on GPUs it runs behind the current block's compute.
Every forward gathers each streamed block once, in order, the same collectives at the same addresses each time.
The resident unit is gathered once and kept; the transformers of one pipeline (Wan 2.2 A14B's two experts) share
one resident region: the expert that runs is gathered into it at its first forward after the other ran (outside any
captured graph: a model's own forward pre-hook), the other stays sharded. A model alone in its region keeps its
resident unit whole, never sharded.

With streamed="tensor", a transformer whose model has a tensor-parallel plan runs its streamed blocks
tensor-parallel instead (tensor_blocks.py), over the ranks of one forward's tokens: they keep their share of the
cut projections and move their tokens, not their weights; where they cannot (no plan, LoRA-wrapped projections,
Wan 2.2's experts), one line says why and they stream gathered.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..context import ParallelContext
from ..core.logs import say_once
from .flat_units import FlatUnit, leaves, nbytes
from .tensor_blocks import run_tensor_parallel, tensor_parallel_refusal
from .weight_split import Split, blocks_of, choose_split, part_sizes, streamed_blocks

logger = logging.getLogger(__name__)
# into one preallocated tensor: all_gather_single where torch has it (2.13), all_gather_into_tensor before
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

CANNOT_UNDO = ("unparallelize cannot undo shard_weights=True (each rank holds only its shards): build or load the "
               "model again")


@dataclass
class _Region:
    """The resident buffer the transformers of a pipeline share, and which one it holds now."""

    buffer: Tensor
    owner: object = None


@dataclass
class WeightPool:
    """The buffers the gathers write into, allocated once: two slots for the streamed blocks, resident regions."""

    group: dist.ProcessGroup
    slots: list[Tensor]
    pending: list[tuple[FlatUnit, dist.Work] | None] = field(default_factory=lambda: [None, None])
    shards: list[Tensor] = field(default_factory=list)  # every shard this rank keeps (for `held_bytes`)
    resident: list[Tensor] = field(default_factory=list)  # every resident buffer (for `held_bytes`)

    def gather(self, unit: FlatUnit, out: Tensor, async_op: bool = False) -> dist.Work | None:
        return _ALL_GATHER(out[:unit.size], unit.shard, group=self.group, async_op=async_op)

    def fetch(self, slot: int, unit: FlatUnit, following: tuple[int, FlatUnit] | None) -> None:
        """`unit` gathered into `slot` (waiting on its prefetch, or now), then `following`'s gather issued."""
        pending = self.pending[slot]
        self.pending[slot] = None
        if pending is not None:
            pending[1].wait()
        if pending is None or pending[0] is not unit:
            self.gather(unit, self.slots[slot])
        if following is not None:
            other, next_unit = following
            if self.pending[other] is not None:  # a prefetch whose block did not run (a cache skipped it)
                self.pending[other][1].wait()
            self.pending[other] = (next_unit, self.gather(next_unit, self.slots[other], async_op=True))


def _streamed(model: nn.Module, keep: int) -> list[tuple[str, nn.Module]]:
    """The blocks of `model` that stream when `keep` stay gathered, with their names."""
    blocks = [b for group in blocks_of(model) for b in group]
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(blocks[i])], blocks[i]) for i in streamed_blocks(len(blocks), keep)]


class _Sharded:
    """One model's units and the hooks that gather them (the streamed blocks of a tensor-parallel model: none)."""

    def __init__(self, model: nn.Module, keep: int, shared: bool, ranks: int, tensor: bool = False):
        named = _streamed(model, keep)
        self.model = model
        self.tensor = named if tensor else []
        self.blocks = [] if tensor else [b for _, b in named]
        self.streamed = [FlatUnit([b], (), ranks) for b in self.blocks]
        self.resident = FlatUnit([model], [b for _, b in named], ranks)
        self.shared = shared  # the resident region is shared with the pipeline's other transformers
        self.region: _Region | None = None
        self.pool: WeightPool | None = None


def _setup(parts: Mapping[str, nn.Module], split: Split, group: dist.ProcessGroup, ranks: int,
           device: torch.device, ctx: ParallelContext) -> WeightPool:
    """Shard `parts` as `split` says over `group` (collective-free: each rank cuts its own shards from the whole
    model it was given), moving everything onto `device` one unit at a time."""
    rank = dist.get_rank(group)
    keep = split.keep
    experts = [n for n in keep if n.startswith("transformer")]
    models = {name: _Sharded(parts[name], k, name in experts and len(experts) > 1, ranks, name in split.tensor)
              for name, k in keep.items()}
    slot = max((u.size for m in models.values() for u in m.streamed), default=0)
    pool = WeightPool(group, [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(2)])
    shared_size = max((m.resident.size for m in models.values() if m.shared), default=0)
    region = _Region(torch.empty(shared_size, dtype=torch.uint8, device=device)) if shared_size else None
    if region is not None:
        pool.resident.append(region.buffer)
    for name, m in models.items():
        for i, (block, unit) in enumerate(zip(m.blocks, m.streamed)):
            unit.keep_shard(unit.flatten(device), rank, own=True)
            pool.shards.append(unit.shard)
            unit.bind(pool.slots[i % 2])
        flat = m.resident.flatten(device)
        if m.shared:
            m.resident.keep_shard(flat, rank, own=True)
            pool.shards.append(m.resident.shard)
            m.resident.bind(region.buffer)
            m.region = region
        else:
            m.resident.keep_shard(flat, rank, own=False)
            pool.resident.append(flat)
            m.resident.bind(flat)
        del flat
        for buf in m.model.buffers():  # buffers (rotary tables, ...) stay whole, on the device
            buf.data = buf.data.to(device)
        if m.tensor:
            installed = m.model._streamfusion
            run_tensor_parallel(m.model, m.tensor, installed.state, ctx.cfg.sp.pg, device,
                                _local_attention(m.model, installed.processors))
        _install_hooks(m, pool)
        m.pool = pool
        m.model._shards = m
    return pool


def _local_attention(model: nn.Module, stock: Mapping[str, object]) -> Callable[[nn.Module], None]:
    """Gives a block's attention modules back their stock processors (attention over tokens none of which are
    split: local, exact)."""
    names = {id(m): n for n, m in model.named_modules()}

    def restore(block: nn.Module) -> None:
        prefix = names[id(block)] + "."
        for key, processor in stock.items():
            if key.startswith(prefix):
                model.get_submodule(key.removesuffix(".processor")).set_processor(processor)
    return restore


def _install_hooks(m: _Sharded, pool: WeightPool) -> None:
    if m.shared:
        def resident(module: nn.Module, args: tuple) -> None:
            if m.region.owner is not m:
                pool.gather(m.resident, m.region.buffer)
                m.region.owner = m
        m.model.register_forward_pre_hook(resident)
    for i, block in enumerate(m.blocks):
        following = (((i + 1) % 2, m.streamed[i + 1]) if i + 1 < len(m.blocks) else None)
        block.register_forward_pre_hook(_fetcher(pool, i % 2, m.streamed[i], following))


def _fetcher(pool: WeightPool, slot: int, unit: FlatUnit, following: tuple[int, FlatUnit] | None
             ) -> Callable[[nn.Module, tuple], None]:
    def fetch(module: nn.Module, args: tuple) -> None:
        pool.fetch(slot, unit, following)
    return torch.compiler.disable(fetch)


def weight_group(ctx: ParallelContext) -> dist.ProcessGroup | None:
    """The ranks that run every forward together (the job, or this rank's world); None on one rank."""
    return ctx.pipeline_group.pg


def shardable_parts(target: nn.Module | object, transformers: list[nn.Module]) -> dict[str, nn.Module]:
    """The transformers and, for a pipeline, its text encoders (every `torch.nn.Module` component named
    text_encoder*), by component name."""
    parts: dict[str, nn.Module] = {f"transformer{'_2' if i else ''}": t for i, t in enumerate(transformers)}
    components = getattr(target, "components", None) or {}
    parts.update({name: c for name, c in components.items()
                  if name.startswith("text_encoder") and isinstance(c, nn.Module)})
    return parts


def tensor_parts(parts: Mapping[str, nn.Module], ctx: ParallelContext) -> list[str]:
    """The transformers among `parts` whose streamed blocks can run tensor-parallel over the ranks of one
    forward's tokens (the sequence-parallel group: with a guidance split, each branch's); why not, said once for
    each that cannot."""
    found = []
    transformers = [n for n in parts if n.startswith("transformer")]
    for name in transformers:
        model = parts[name]
        why = ("Wan 2.2's experts share one resident region" if len(transformers) > 1 else
               tensor_parallel_refusal(model, _streamed(model, 0), ctx.world_size))
        if why:
            say_once(logger, logging.WARNING, "shard_weights: %s streams its blocks gathered, not tensor-parallel: "
                     "%s", name, why)
        else:
            found.append(name)
    return found


def shard_pipeline(target: nn.Module | object, transformers: list[nn.Module], ctx: ParallelContext,
                   budget: int | None = None, streamed: str = "gather") -> tuple[list[str], Split | None]:
    """Shard the parts as far as `budget` (bytes of weights per rank; None: every block streams) needs, the
    streamed blocks gathered or (streamed="tensor", where they can) run tensor-parallel. Returns the names of what
    was sharded and the split (None on one rank: nothing to shard)."""
    group = weight_group(ctx)
    if group is None:
        say_once(logger, logging.INFO, "shard_weights: one rank, nothing to shard")
        return [], None
    parts = shardable_parts(target, transformers)
    ranks = dist.get_world_size(group)
    sizes = {name: part_sizes(p) for name, p in parts.items()}
    tensor = tensor_parts(parts, ctx) if streamed == "tensor" and ctx.world_size > 1 else []
    split = choose_split(sizes, ranks, budget, tensor, ctx.world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    _setup(parts, split, group, ranks, device, ctx)
    say_once(logger, logging.INFO, "shard_weights over %d ranks: %s; %.2f GiB held per rank", ranks,
             split.describe(sizes), split.held / 2**30)
    return list(split.keep), split


def is_sharded(model: nn.Module) -> bool:
    return getattr(model, "_shards", None) is not None


def held_bytes(models: Sequence[nn.Module]) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole models) of the models' parameters: every distinct storage
    counted once (the slots and regions the gathered parameters view, the shards kept beside them)."""
    storages: dict[int, int] = {}
    whole = 0
    for model in models:
        for p in model.parameters():
            whole += sum(nbytes(leaf) for leaf in leaves(p))
            for leaf in leaves(p):
                storage = leaf.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        m = getattr(model, "_shards", None)
        if m is not None:  # the shards, and both slots (the second one viewed by no parameter where one streams)
            for tensor in [*(unit.shard for unit in [*m.streamed, m.resident]), *m.pool.slots]:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), whole


__all__ = ["CANNOT_UNDO", "WeightPool", "held_bytes", "is_sharded", "shard_pipeline", "shardable_parts",
           "weight_group"]

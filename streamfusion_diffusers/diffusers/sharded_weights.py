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


class _Sharded:
    """One model's units and the hooks that gather them."""

    def __init__(self, model: nn.Module, keep: int, shared: bool, ranks: int):
        blocks = [b for group in blocks_of(model) for b in group]
        streamed = set(streamed_blocks(len(blocks), keep))
        self.model = model
        self.blocks = [b for i, b in enumerate(blocks) if i in streamed]
        self.streamed = [FlatUnit([b], (), ranks) for b in self.blocks]
        self.resident = FlatUnit([model], self.blocks, ranks)
        self.shared = shared  # the resident region is shared with the pipeline's other transformers
        self.region: _Region | None = None
        self.pool: WeightPool | None = None


def _setup(parts: Mapping[str, nn.Module], keep: Mapping[str, int], group: dist.ProcessGroup, ranks: int,
           device: torch.device) -> WeightPool:
    """Shard `parts` as `keep` says over `group` (collective-free: each rank cuts its own shards from the whole
    model it was given), moving everything onto `device` one unit at a time."""
    rank = dist.get_rank(group)
    experts = [n for n in keep if n.startswith("transformer")]
    models = {name: _Sharded(parts[name], k, name in experts and len(experts) > 1, ranks) for name, k in keep.items()}
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
        _install_hooks(m, pool)
        m.pool = pool
        m.model._shards = m
    return pool


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


def shard_pipeline(target: nn.Module | object, transformers: list[nn.Module], ctx: ParallelContext,
                   budget: int | None = None) -> tuple[list[str], Split | None]:
    """Shard the parts as far as `budget` (bytes of weights per rank; None: every block streams) needs. Returns
    the names of what was sharded and the split (None on one rank: nothing to shard)."""
    group = weight_group(ctx)
    if group is None:
        say_once(logger, logging.INFO, "shard_weights: one rank, nothing to shard")
        return [], None
    parts = shardable_parts(target, transformers)
    ranks = dist.get_world_size(group)
    sizes = {name: part_sizes(p) for name, p in parts.items()}
    split = choose_split(sizes, ranks, budget)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    _setup(parts, split.keep, group, ranks, device)
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

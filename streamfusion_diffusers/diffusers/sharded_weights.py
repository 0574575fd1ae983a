"""Every rank a share of the weights, gathered in place: `parallelize(..., shard_weights=True)`.

Sequence parallelism splits the tokens and leaves every rank the whole model; sharding splits the weights too,
only as far as memory needs. Each repeated block (the model's `_no_split_modules` classes: diffusers' transformer
blocks, transformers' encoder layers) is one unit; the model's other parameters (the root) and the blocks the
split keeps are one more, the resident unit. A unit's parameters (a quantized weight's inner tensors too: torchao's
int8 / fp8 data and scales, 1 byte a value) are laid end to end in one flat byte buffer, of which each rank keeps
1/P; a `dist.all_gather_into_tensor` over the ranks that run every forward together rebuilds it whole.

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

Which blocks stream (`Split`): as few as the memory budget needs (`choose_split`, used by the memory planner too);
the kept ones spread between the streamed ones, so each prefetch has kept blocks' compute to hide behind.
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

logger = logging.getLogger(__name__)
# into one preallocated tensor: all_gather_single where torch has it (2.13), all_gather_into_tensor before
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

ALIGN = 16  # bytes: every tensor starts at a multiple of this in its flat buffer (any dtype's view is aligned)
CANNOT_UNDO = ("unparallelize cannot undo shard_weights=True (each rank holds only its shards): build or load the "
               "model again")


def blocks_of(model: nn.Module) -> list[list[nn.Module]]:
    """The model's repeated blocks, in order, grouped by the list that holds them: the modules of its
    `_no_split_modules` classes (the ones diffusers and accelerate keep whole on one device), outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: dict[int, list[nn.Module]] = {}
    inside: set[int] = set()
    for parent in model.modules():
        if id(parent) in inside:
            continue
        for child in parent.children():
            if type(child).__name__ in names and id(child) not in inside:
                found.setdefault(id(parent), []).append(child)
                inside.update(id(m) for m in child.modules())
    return list(found.values())


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _leaves(t: Tensor) -> list[Tensor]:
    """The plain tensors a parameter holds: itself, or a tensor subclass's (torchao's) inner tensors, recursively."""
    if type(t) in (Tensor, nn.Parameter):
        return [t.detach()]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in _leaves(getattr(t, name))]


def _rebuild(t: Tensor, leaves: list[Tensor]) -> Tensor:
    """t rebuilt around `leaves` (in `_leaves`' order), consumed from the front."""
    if type(t) in (Tensor, nn.Parameter):
        return leaves.pop(0)
    names, ctx = t.__tensor_flatten__()
    inner = {name: _rebuild(getattr(t, name), leaves) for name in names}
    return type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())


def unit_bytes(modules: Sequence[nn.Module], skip: Sequence[nn.Module] = ()) -> int:
    """The flat buffer size of these modules' parameters (those of `skip`'s subtrees left out), before padding."""
    skipped = {id(p) for m in skip for p in m.parameters()}
    seen: set[int] = set()
    size = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and id(p) not in skipped:
                seen.add(id(p))
                size += sum(-(-_nbytes(leaf) // ALIGN) * ALIGN for leaf in _leaves(p))
    return size


def padded(size: int, ranks: int) -> int:
    """A flat buffer's size rounded up so that it splits into `ranks` aligned shards."""
    step = ranks * ALIGN
    return -(-size // step) * step


@dataclass(frozen=True)
class PartSizes:
    """A module's flat bytes: its root (outside every block) and each block's, in the order they run."""

    root: int
    blocks: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.root + sum(self.blocks)


def part_sizes(model: nn.Module) -> PartSizes:
    blocks = [b for group in blocks_of(model) for b in group]
    return PartSizes(unit_bytes([model], skip=blocks), tuple(unit_bytes([b]) for b in blocks))


def streamed_blocks(count: int, keep: int) -> list[int]:
    """Which of `count` blocks stream when `keep` of them stay gathered: spread evenly among the kept ones."""
    stream = count - keep
    return sorted({min(count - 1, int((i + 0.5) * count / stream)) for i in range(stream)}) if stream > 0 else []


@dataclass(frozen=True)
class Split:
    """How many blocks of each part stay gathered (`keep`; a part absent is not sharded at all, whole on every
    rank); the transformers (`experts`) share one resident region. `held` is a rank's weight bytes with it, slots
    included; `received` the bytes a rank receives per forward of the largest transformer."""

    keep: dict[str, int]
    held: int
    received: int
    slots: int  # of `held`: the two slots the streamed blocks are gathered into

    def describe(self, sizes: Mapping[str, PartSizes]) -> str:
        parts = [f"{name} {keep}/{len(sizes[name].blocks)} kept" for name, keep in self.keep.items()]
        whole = [name for name in sizes if name not in self.keep]
        return ", ".join(parts + ([f"whole: {', '.join(whole)}"] if whole else [])) or "nothing sharded"


def split_cost(sizes: Mapping[str, PartSizes], keep: Mapping[str, int], ranks: int) -> Split:
    """The held and received bytes per rank of sharding `keep`'s parts so (the layout `shard_pipeline` builds)."""
    held = sum(s.total for name, s in sizes.items() if name not in keep)
    slot = received = 0
    experts = [name for name in keep if name.startswith("transformer")]
    region = 0
    for name, k in keep.items():
        s = sizes[name]
        streamed = [s.blocks[i] for i in streamed_blocks(len(s.blocks), k)]
        resident = s.root + sum(s.blocks) - sum(streamed)
        shards = sum(padded(b, ranks) // ranks for b in streamed)
        if name in experts and len(experts) > 1:  # sharded too, gathered into the shared region
            shards += padded(resident, ranks) // ranks
            region = max(region, padded(resident, ranks))
        else:
            shards += padded(resident, ranks)
        held += shards
        slot = max(slot, *(padded(b, ranks) for b in streamed), 0)
        if name in experts:
            received = max(received, sum(padded(b, ranks) for b in streamed) * (ranks - 1) // ranks)
    return Split(dict(keep), held + region + 2 * slot, received, 2 * slot)


def choose_split(sizes: Mapping[str, PartSizes], ranks: int, budget: int | None) -> Split:
    """The split that fits `budget` bytes per rank streaming the fewest blocks: the most transformer blocks kept
    gathered that fit (the same count for every expert; a lone transformer with all of them kept is left whole),
    then each text encoder whole where it still fits (they run once per prompt: they stream first); where nothing
    fits, the split that holds least. None: everything sharded, every block streamed."""
    keep = {name: 0 for name in sizes}
    if budget is None:
        return split_cost(sizes, keep, ranks)
    experts = [n for n in sizes if n.startswith("transformer")]
    most = max((len(sizes[n].blocks) for n in experts), default=0)

    def kept(k: int) -> dict[str, int]:
        trial = {**keep, **{n: min(k, len(sizes[n].blocks)) for n in experts}}
        if len(experts) == 1 and k == most:  # all of it kept: whole, not sharded
            del trial[experts[0]]
        return trial

    trials = [split_cost(sizes, kept(k), ranks) for k in range(most + 1)]
    fitting = [t for t in trials if t.held <= budget]
    best = fitting[-1] if fitting else min(trials, key=lambda t: t.held)
    keep = dict(best.keep)
    for name in [n for n in sizes if n not in experts]:
        trial = {n: k for n, k in keep.items() if n != name}
        if split_cost(sizes, trial, ranks).held <= budget:
            keep = trial
    return split_cost(sizes, keep, ranks)


class _Unit:
    """One flat buffer's worth of parameters: where each lives in the buffer, this rank's shard of it."""

    def __init__(self, modules: Sequence[nn.Module], skip: Sequence[nn.Module], ranks: int):
        skipped = {id(p) for m in skip for p in m.parameters()}
        inside = {id(sub) for m in skip for sub in m.modules()}
        sites: dict[int, list[tuple[nn.Module, str]]] = {}
        params: dict[int, Tensor] = {}
        for module in modules:
            for sub in module.modules():
                if id(sub) in inside:
                    continue
                for name, p in sub._parameters.items():
                    if p is not None and id(p) not in skipped:
                        params[id(p)] = p
                        sites.setdefault(id(p), []).append((sub, name))
        self.params = list(params.values())
        self.sites = [sites[id(p)] for p in self.params]
        self.offsets: list[list[int]] = []
        size = 0
        for p in self.params:
            offs = []
            for leaf in _leaves(p):
                offs.append(size)
                size += -(-_nbytes(leaf) // ALIGN) * ALIGN
            self.offsets.append(offs)
        self.size = padded(size, ranks)
        self.ranks = ranks
        self.shard: Tensor | None = None

    def flatten(self, device: torch.device) -> Tensor:
        """The unit's parameters laid end to end, as bytes, on `device`."""
        flat = torch.zeros(self.size, dtype=torch.uint8, device=device)
        for p, offs in zip(self.params, self.offsets):
            for leaf, off in zip(_leaves(p), offs):
                flat[off:off + _nbytes(leaf)].copy_(leaf.contiguous().reshape(-1).view(torch.uint8))
        return flat

    def keep_shard(self, flat: Tensor, rank: int, own: bool) -> None:
        """This rank's 1/P of `flat`: its own copy, or (own=False: the flat stays whole) a view into it."""
        share = self.size // self.ranks
        piece = flat[rank * share:(rank + 1) * share]
        self.shard = piece.clone() if own else piece

    def bind(self, buffer: Tensor) -> None:
        """Every parameter a view into `buffer` (the gathered flat), its dtype, shape and strides kept."""
        for i, (p, offs, sites) in enumerate(zip(self.params, self.offsets, self.sites)):
            leaves = _leaves(p)
            views = [buffer[off:off + _nbytes(leaf)].view(leaf.dtype).view(leaf.shape)
                     for leaf, off in zip(leaves, offs)]
            new = nn.Parameter(_rebuild(p, views), requires_grad=False)
            for module, name in sites:
                module._parameters[name] = new
            self.params[i] = new


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
    pending: list[tuple[_Unit, dist.Work] | None] = field(default_factory=lambda: [None, None])
    shards: list[Tensor] = field(default_factory=list)  # every shard this rank keeps (for `held_bytes`)
    resident: list[Tensor] = field(default_factory=list)  # every resident buffer (for `held_bytes`)

    def gather(self, unit: _Unit, out: Tensor, async_op: bool = False) -> dist.Work | None:
        return _ALL_GATHER(out[:unit.size], unit.shard, group=self.group, async_op=async_op)

    def fetch(self, slot: int, unit: _Unit, following: tuple[int, _Unit] | None) -> None:
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
        self.streamed = [_Unit([b], (), ranks) for b in self.blocks]
        self.resident = _Unit([model], self.blocks, ranks)
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


def _fetcher(pool: WeightPool, slot: int, unit: _Unit, following: tuple[int, _Unit] | None
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
            whole += sum(_nbytes(leaf) for leaf in _leaves(p))
            for leaf in _leaves(p):
                storage = leaf.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        m = getattr(model, "_shards", None)
        if m is not None:  # the shards, and both slots (the second one viewed by no parameter where one streams)
            for tensor in [*(unit.shard for unit in [*m.streamed, m.resident]), *m.pool.slots]:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()), whole


__all__ = ["CANNOT_UNDO", "PartSizes", "Split", "WeightPool", "blocks_of", "choose_split", "held_bytes",
           "is_sharded", "part_sizes", "shard_pipeline", "shardable_parts", "split_cost", "streamed_blocks",
           "unit_bytes"]

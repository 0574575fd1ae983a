"""What `shard_weights` shards: the model's repeated blocks, their flat sizes, and the split that fits a budget.

Each repeated block (the model's `_no_split_modules` classes: diffusers' transformer blocks, transformers' encoder
layers) is one unit; the model's other parameters (the root) and the blocks the split keeps are one more, the
resident unit. Which blocks stream (`Split`): as few as the memory budget needs (`choose_split`, used by the memory
planner too); the kept ones spread between the streamed ones, so each prefetch has kept blocks' compute to hide
behind. The costs count the bytes of the layout sharded_weights.py builds (flat_units.py), slots and regions
included, without building it. Streamed blocks run tensor-parallel instead (tensor_blocks.py) hold 1/P of the
projections their model's plan cuts and the rest whole, and need no slot.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from .flat_units import leaves, nbytes, padded, unit_bytes
from .tensor_blocks import block_plan, sliced_bytes, summed_rows


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


@dataclass(frozen=True)
class PartSizes:
    """A module's flat bytes: its root (outside every block) and each block's, in the order they run; for blocks
    that can run tensor-parallel, each one's bytes unpadded (`exact`), those its model's plan cuts (`sliced`) and
    the whole row sets its all-reduces carry a forward (`summed`)."""

    root: int
    blocks: tuple[int, ...]
    exact: tuple[int, ...] = ()
    sliced: tuple[int, ...] = ()
    summed: tuple[tuple[int, int], ...] = ()  # per block: its all-reduces of (image, text) rows a forward

    def tensor_held(self, i: int, ranks: int) -> int:
        """The bytes block i holds on a rank when it runs tensor-parallel over `ranks` (its forward's ranks)."""
        return self.exact[i] - self.sliced[i] + self.sliced[i] // ranks

    @property
    def total(self) -> int:
        return self.root + sum(self.blocks)


def part_sizes(model: nn.Module) -> PartSizes:
    blocks = [b for group in blocks_of(model) for b in group]
    names = {id(m): n for n, m in model.named_modules()}
    plans = [block_plan(model, names[id(b)], b) for b in blocks]
    sliced = tuple(sliced_bytes(plan) for plan in plans)
    exact = tuple(sum(nbytes(leaf) for p in b.parameters() for leaf in leaves(p)) for b in blocks)
    summed = tuple(summed_rows(b) for b in blocks)
    tensor = any(sliced)
    return PartSizes(unit_bytes([model], skip=blocks), tuple(unit_bytes([b]) for b in blocks),
                     exact if tensor else (), sliced if tensor else (), summed if tensor else ())


def streamed_blocks(count: int, keep: int) -> list[int]:
    """Which of `count` blocks stream when `keep` of them stay gathered: spread evenly among the kept ones."""
    stream = count - keep
    return sorted({min(count - 1, int((i + 0.5) * count / stream)) for i in range(stream)}) if stream > 0 else []


@dataclass(frozen=True)
class Split:
    """How many blocks of each part stay gathered (`keep`; a part absent is not sharded at all, whole on every
    rank); the transformers (`experts`) share one resident region. `held` is a rank's weight bytes with it, slots
    included; `received` the weight bytes a rank receives per forward of the largest transformer. The parts in
    `tensor` run their streamed blocks tensor-parallel (their tokens move, not their weights)."""

    keep: dict[str, int]
    held: int
    received: int
    slots: int  # of `held`: the two slots the streamed blocks are gathered into
    tensor: tuple[str, ...] = ()

    def describe(self, sizes: Mapping[str, PartSizes]) -> str:
        parts = [f"{name} {keep}/{len(sizes[name].blocks)} kept{' (tensor-parallel)' if name in self.tensor else ''}"
                 for name, keep in self.keep.items()]
        whole = [name for name in sizes if name not in self.keep]
        return ", ".join(parts + ([f"whole: {', '.join(whole)}"] if whole else [])) or "nothing sharded"


def split_cost(sizes: Mapping[str, PartSizes], keep: Mapping[str, int], ranks: int, tensor: Sequence[str] = (),
               tensor_ranks: int | None = None) -> Split:
    """The held and received bytes per rank of sharding `keep`'s parts so (the layout `shard_pipeline` builds),
    the parts in `tensor` running their streamed blocks tensor-parallel over `tensor_ranks` (the ranks of one
    forward's tokens; default all `ranks`: fewer with a guidance split, each branch its own)."""
    held = sum(s.total for name, s in sizes.items() if name not in keep)
    slot = received = 0
    experts = [name for name in keep if name.startswith("transformer")]
    tensor = tuple(name for name in tensor if name in keep and sizes[name].sliced)
    region = 0
    for name, k in keep.items():
        s = sizes[name]
        which = streamed_blocks(len(s.blocks), k)
        streamed = [s.blocks[i] for i in which]
        resident = s.root + sum(s.blocks) - sum(streamed)
        if name in tensor:
            held += padded(resident, ranks) + sum(s.tensor_held(i, tensor_ranks or ranks) for i in which)
            continue
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
    return Split(dict(keep), held + region + 2 * slot, received, 2 * slot, tensor)


def choose_split(sizes: Mapping[str, PartSizes], ranks: int, budget: int | None, tensor: Sequence[str] = (),
                 tensor_ranks: int | None = None) -> Split:
    """The split that fits `budget` bytes per rank streaming the fewest blocks: the most transformer blocks kept
    gathered that fit (the same count for every expert; a lone transformer with all of them kept is left whole),
    then each text encoder whole where it still fits (they run once per prompt: they stream first); where nothing
    fits, the split that holds least. None: everything sharded, every block streamed. `tensor`: the parts whose
    streamed blocks run tensor-parallel (where they can), over `tensor_ranks`."""
    keep = {name: 0 for name in sizes}
    if budget is None:
        return split_cost(sizes, keep, ranks, tensor, tensor_ranks)
    experts = [n for n in sizes if n.startswith("transformer")]
    most = max((len(sizes[n].blocks) for n in experts), default=0)

    def kept(k: int) -> dict[str, int]:
        trial = {**keep, **{n: min(k, len(sizes[n].blocks)) for n in experts}}
        if len(experts) == 1 and k == most:  # all of it kept: whole, not sharded
            del trial[experts[0]]
        return trial

    trials = [split_cost(sizes, kept(k), ranks, tensor, tensor_ranks) for k in range(most + 1)]
    fitting = [t for t in trials if t.held <= budget]
    best = fitting[-1] if fitting else min(trials, key=lambda t: t.held)
    keep = dict(best.keep)
    for name in [n for n in sizes if n not in experts]:
        trial = {n: k for n, k in keep.items() if n != name}
        if split_cost(sizes, trial, ranks, tensor, tensor_ranks).held <= budget:
            keep = trial
    return split_cost(sizes, keep, ranks, tensor, tensor_ranks)


__all__ = ["PartSizes", "Split", "blocks_of", "choose_split", "part_sizes", "split_cost", "streamed_blocks"]

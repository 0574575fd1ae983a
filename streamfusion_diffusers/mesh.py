"""The 3-D mesh (torus T, intra-Ulysses U', ring R) of a resolved layout, and its process groups.

Every method is a point in this mesh: ulysses = (1, P, 1), ring = (1, 1, P), usp and tas = (1, U, R) with
Ulysses peers adjacent (usp) or ring peers adjacent (tas), torus = (T, U/T, R) with TAS placement. Rank
order is the global sequence order; `Layout.rank` maps coordinates to ranks.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .config import Layout


@dataclass(frozen=True)
class Group:
    """One process group of the mesh as this rank sees it: member ranks in group order, its own place, and
    which dimension it spans ("torus", "ulysses", "ring" or "world"; one-sided transports pick a stream by it)."""

    ranks: tuple[int, ...]
    index: int
    pg: dist.ProcessGroup | None
    name: str = ""

    @property
    def size(self) -> int:
        return len(self.ranks)


class Mesh:
    """This rank's coordinates in a layout and the torus, intra-Ulysses, ring and world groups it belongs to.

    Creating a Mesh is collective: every rank of the job must build the same layouts in the same order.
    `worlds` lists every sequence-parallel world of the job as global ranks in sequence order, when a job runs
    several side by side (xDiT's CFG branches); None: one world, ranks 0..P-1. `rank` is this process's place
    in its own world. Every rank creates every world's groups, in one order, as torch.distributed requires.
    """

    def __init__(self, layout: Layout, rank: int, timeout_s: float,
                 worlds: Sequence[Sequence[int]] | None = None):
        self.layout, self.rank = layout, rank
        self.t, self.u, self.r = layout.coords(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        me = dist.get_rank() if worlds else rank
        all_worlds = [tuple(w) for w in worlds] if worlds else [tuple(range(layout.world_size))]
        lay = layout
        dims = {
            "torus": (lay.torus, lambda i, a, b: lay.rank(i, a, b), (lay.ulysses_intra, lay.ring)),
            "ulysses": (lay.ulysses_intra, lambda i, a, b: lay.rank(a, i, b), (lay.torus, lay.ring)),
            "ring": (lay.ring, lambda i, a, b: lay.rank(a, b, i), (lay.torus, lay.ulysses_intra)),
        }
        groups: dict[str, Group] = {}
        for world in all_worlds:
            for name, (size, to_rank, (n_a, n_b)) in dims.items():
                for a in range(n_a):
                    for b in range(n_b):
                        ranks = tuple(world[to_rank(i, a, b)] for i in range(size))
                        pg = dist.new_group(list(ranks), timeout=timeout) if size > 1 else None
                        if me in ranks:
                            groups[name] = Group(ranks, ranks.index(me), pg, name)
        self.torus, self.ulysses, self.ring = groups["torus"], groups["ulysses"], groups["ring"]
        if not worlds:
            self.world = Group(all_worlds[0], rank, dist.group.WORLD if layout.world_size > 1 else None, "world")
        for world in all_worlds if worlds else ():
            pg = dist.new_group(list(world), timeout=timeout) if len(world) > 1 else None
            if me in world:
                self.world = Group(world, rank, pg, "world")

    def part_len(self, seq_lens: Sequence[int], t: int, r: int) -> int:
        """Tokens of torus part t as held by ring peer r: its intra-Ulysses group's slices together."""
        lay = self.layout
        return sum(seq_lens[lay.rank(t, u, r)] for u in range(lay.ulysses_intra))

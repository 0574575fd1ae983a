"""The 3-D mesh (torus T, intra-Ulysses U', ring R) of a resolved layout, and its process groups.

Every method is a point in this mesh: ulysses = (1, P, 1), ring = (1, 1, P), usp and tas = (1, U, R) with
Ulysses peers adjacent (usp) or ring peers adjacent (tas), torus = (T, U/T, R) with TAS placement. Rank
order is the global sequence order; `Layout.rank` maps coordinates to ranks.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from .config import Layout, cfg_shape
from .one_time import one_time


@dataclass(frozen=True)
class Group:
    """One process group of the mesh as this rank sees it: member ranks in group order, its own place, and
    which dimension it spans ("torus", "ulysses_intra", "ring" or "world"; one-sided transports pick a stream by
    it)."""

    ranks: tuple[int, ...]
    index: int
    pg: dist.ProcessGroup | None
    name: str = ""

    @property
    def size(self) -> int:
        return len(self.ranks)


def cfg_branches(machines: int, gpus_per_machine: int, cfg: int) -> tuple[tuple[int, ...], ...]:
    """Global ranks of each guidance branch, in the branch's SP rank order (see `config.cfg_shape`): contiguous
    halves of the machines when the machine count is even, else the same half of every machine."""
    n, m = cfg_shape(machines, gpus_per_machine, cfg)
    if n != machines:
        return tuple(tuple(range(b * n * m, (b + 1) * n * m)) for b in range(cfg))
    return tuple(tuple(machine * gpus_per_machine + b * m + local for machine in range(n) for local in range(m))
                 for b in range(cfg))


class GroupCache:
    """The process groups a context creates, kept for reuse: the world group per timeout, the CFG groups per
    branch split, one Mesh per layout, and those another library makes for the job (`other`). Created with a ParallelContext and shared by the contexts made from it
    (init_parallel(groups=ctx.groups): bench compares many layouts in one job), emptied by `shutdown(ctx)`.
    Bounded: past MAX_MESHES layouts the oldest mesh is forgotten (every rank asks in the same order, so every
    rank forgets the same one; a later request creates its groups again, collectively)."""

    MAX_MESHES = 64

    def __init__(self) -> None:
        self.worlds: dict[float, dist.ProcessGroup] = {}
        self.branches: dict[tuple, CfgGroups] = {}
        self.meshes: dict[tuple, Mesh] = {}
        self.others: dict[Hashable, object] = {}

    def world(self, timeout_s: float) -> dist.ProcessGroup:
        """All ranks of the job in one group that times out after timeout_s (the default group keeps whatever
        timeout the job was started with). Collective on first use."""
        if timeout_s not in self.worlds:
            with one_time("process groups"):
                self.worlds[timeout_s] = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        return self.worlds[timeout_s]

    def mesh(self, layout: Layout, rank: int, timeout_s: float, cfg: CfgGroups) -> Mesh:
        """The Mesh of a layout and CFG split, built (collectively) on first use; layouts that place the ranks
        alike under different names (Layout.placement) share one."""
        layout = layout.placement
        key = (layout, timeout_s, cfg.branches)
        if key not in self.meshes:
            if len(self.meshes) >= self.MAX_MESHES:
                del self.meshes[next(iter(self.meshes))]
            with one_time("process groups"):
                self.meshes[key] = Mesh(layout, rank, timeout_s, cfg)
        return self.meshes[key]

    def other(self, key: Hashable, make: Callable[[], object]) -> object:
        """What `make` returns (another library's process groups: the bench's xDiT baseline's), made once per
        key (collectively, as every group) and forgotten with ours."""
        if key not in self.others:
            self.others[key] = make()
        return self.others[key]

    def clear(self) -> None:
        self.worlds.clear()
        self.branches.clear()
        self.meshes.clear()
        self.others.clear()


@dataclass(frozen=True)
class CfgGroups:
    """The classifier-free-guidance dimension as this rank sees it: its branch's SP group (the "world" of every
    mesh built for it) and the group of the ranks at the same SP position in every branch."""

    branches: tuple[tuple[int, ...], ...]
    sp: Group
    cfg: Group

    @property
    def degree(self) -> int:
        return len(self.branches)

    @classmethod
    def build(cls, machines: int, gpus_per_machine: int, cfg: int, rank: int, timeout_s: float,
              groups: GroupCache) -> "CfgGroups":
        """Collective when cfg > 1 (every rank creates every branch's and every position's process group)."""
        branches = cfg_branches(machines, gpus_per_machine, cfg)
        if cfg == 1:
            world = groups.world(timeout_s) if len(branches[0]) > 1 else None
            return cls(branches, Group(branches[0], rank, world, "world"), Group((rank,), 0, None, "cfg"))
        return cls.of_branches(branches, rank, timeout_s, groups)

    @classmethod
    def of_branches(cls, branches: tuple[tuple[int, ...], ...], rank: int, timeout_s: float,
                    groups: GroupCache) -> "CfgGroups":
        """Groups for branches the caller placed (xDiT's SP groups); collective, like `build`, on first use: one
        set per branches and timeout in the context's group cache."""
        key = (tuple(map(tuple, branches)), rank, timeout_s)
        if key not in groups.branches:
            groups.branches[key] = cls._create(key[0], rank, timeout_s)
        return groups.branches[key]

    @classmethod
    def _create(cls, branches: tuple[tuple[int, ...], ...], rank: int, timeout_s: float) -> "CfgGroups":
        timeout = datetime.timedelta(seconds=timeout_s)

        def mine(all_groups: tuple[tuple[int, ...], ...], name: str) -> Group:
            found = None
            for ranks in all_groups:
                pg = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    found = Group(ranks, ranks.index(rank), pg, name)
            return found

        sp = mine(branches, "world")
        cfg_group = mine(tuple(zip(*branches)), "cfg")
        return cls(branches, sp, cfg_group)


class Mesh:
    """This rank's coordinates in a layout and the torus, intra-Ulysses, ring and world groups it belongs to.

    With CFG parallelism the layout is one branch's SP layout: its ranks are positions in the branch, mapped to
    global ranks through `cfg.branches`, and "world" is the branch's SP group. Creating a Mesh is collective:
    every rank of the job must build the same layouts in the same order.
    """

    def __init__(self, layout: Layout, rank: int, timeout_s: float, cfg: CfgGroups | None = None):
        branches = cfg.branches if cfg is not None else (tuple(range(layout.world_size)),)
        self.layout, self.rank = layout, rank
        self.t, self.u, self.r = layout.coords(cfg.sp.index if cfg is not None else rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        lay = layout
        dims = {
            "torus": (lay.torus, lambda i, a, b: lay.rank(i, a, b), (lay.ulysses_intra, lay.ring)),
            "ulysses_intra": (lay.ulysses_intra, lambda i, a, b: lay.rank(a, i, b), (lay.torus, lay.ring)),
            "ring": (lay.ring, lambda i, a, b: lay.rank(a, b, i), (lay.torus, lay.ulysses_intra)),
        }
        groups: dict[str, Group] = {}
        for name, (size, to_rank, (n_a, n_b)) in dims.items():
            for branch in branches:
                for a in range(n_a):
                    for b in range(n_b):
                        ranks = tuple(branch[to_rank(i, a, b)] for i in range(size))
                        pg = dist.new_group(list(ranks), timeout=timeout) if size > 1 else None
                        if rank in ranks:
                            groups[name] = Group(ranks, ranks.index(rank), pg, name)
        # the intra-Ulysses group spans U' = U / T ranks: `Layout.ulysses` is the whole degree U
        self.torus, self.ulysses_intra, self.ring = groups["torus"], groups["ulysses_intra"], groups["ring"]
        # this rank's intra-Ulysses peers as positions in the layout (indexes into every rank's slice lengths)
        self.ulysses_peers = tuple(lay.rank(self.t, u, self.r) for u in range(lay.ulysses_intra))
        if cfg is not None:
            self.world = cfg.sp
        else:
            world = tuple(range(layout.world_size))
            self.world = Group(world, rank, dist.group.WORLD if layout.world_size > 1 else None, "world")

    def part_len(self, seq_lens: Sequence[int], t: int, r: int) -> int:
        """Tokens of torus part t as held by ring peer r: its intra-Ulysses group's slices together."""
        lay = self.layout
        return sum(seq_lens[lay.rank(t, u, r)] for u in range(lay.ulysses_intra))

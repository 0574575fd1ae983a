"""The attention test matrix, shared by the per-world-size test modules (each owns one process pool)."""
from __future__ import annotations

import random

from sp_cases import Problem, even, uneven

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.core.config import METHODS, divisors


def problems(method: str, world: int) -> list[tuple[Problem, bool]]:
    """(problem, pass seq_lens) pairs: heads 24, 48 and a small count; head dims 64, 128; batch 1, 2;
    no joint tokens, 226 and 512 of them; even and fresh uneven slices."""
    seed = random.SystemRandom().randrange(2**31)
    small = world if method == "ulysses" else 6 if world > 1 else 3
    length = 7 * world + 3
    return [
        (Problem(24, 128, 1, even(6, world)), False),
        (Problem(48, 64, 2, uneven(length, world, seed), joint=226), True),
        (Problem(small, 64, 1, uneven(length, world, seed + 1), joint=512), True),
        (Problem(24, 64, 2, even(5, world), joint=512), False),
    ]


def layouts(world: int, heads: int = 24) -> list[ParallelConfig]:
    """Every UxR split of USP and TAS, and every Torus degree T dividing U, on one machine shape."""
    machines = 2 if world % 2 == 0 and world > 1 else 1
    shape = dict(machines=machines, gpus_per_machine=world // machines)
    out = []
    for u in (d for d in divisors(world) if heads % d == 0):
        out += [ParallelConfig(method=m, ulysses=u, ring=world // u, **shape) for m in ("usp", "tas")]
        out += [ParallelConfig(method="torus", ulysses=u, torus=t, **shape) for t in divisors(u)]
    return out


def layout_problem(world: int) -> Problem:
    """Small head dim for speed; 3 joint tokens, so some ring peers hold no joint query rows."""
    seed = random.SystemRandom().randrange(2**31)
    return Problem(24, 32, 1, uneven(5 * world + 1, world, seed), joint=3)


def layout_id(config: ParallelConfig) -> str:
    torus = f"T{config.torus}" if config.torus else ""
    ring = config.ring or 0
    return f"{config.method}-U{config.ulysses}R{ring}{torus}" if ring else f"{config.method}-U{config.ulysses}{torus}"


__all__ = ["METHODS", "layout_id", "layouts", "layout_problem", "problems"]

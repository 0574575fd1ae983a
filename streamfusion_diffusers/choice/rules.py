"""Rules from measurements that overrule the cost model where it is known to be optimistic.

Torus inside one machine. On one machine every Torus stage moves its chunk over NVLink in a fraction of the
attention it overlaps, so what Torus hides is small, while its fixed costs stay: T stage launches, per-chunk
layout copies, T x R attention calls instead of one, log-sum-exp merges, a barrier per layer. The cost model
counts none of these and ranks Torus a close second everywhere, where the one-machine layer timings
(`recipes/measurements.json`) have it losing to the best other layout at every share they hold, by less as the
share grows. So on one machine Torus (T > 1) is a candidate only above the largest share at which it was
recorded losing, TORUS_MIN_TOKENS_PER_GPU (tests/test_torus_rule.py derives it from measurements.json again).
Beyond it nothing was measured and the cost model decides; across machines Torus always is a candidate (there
it hides slow transfers). A recipe entry that `streamfusion tune` measures on your machine comes before this
rule.
"""
from __future__ import annotations

from ..core.config import Layout
from .workloads import Workload

# one above the largest share at which Torus lost on one machine (recipes/measurements.json; its log
# benchmarks/results/2026-11-23-h200x2/tune-1x2-real.log)
TORUS_MIN_TOKENS_PER_GPU = 83_754


def tokens_per_gpu(w: Workload, world: int) -> float:
    return (w.tokens + w.text_tokens) / world


def torus_off(lay: Layout, w: Workload) -> bool:
    """Whether the one-machine Torus rule takes this layout out of the running for this shape."""
    return lay.machines == 1 and lay.torus > 1 and tokens_per_gpu(w, lay.world_size) < TORUS_MIN_TOKENS_PER_GPU


def why_torus_off(w: Workload, world: int) -> str:
    return (f"Torus left out: one machine, {tokens_per_gpu(w, world):.0f} tokens per GPU < "
            f"{TORUS_MIN_TOKENS_PER_GPU} (below it Torus lost at every share measured on 1 x 2: choice/rules.py)")


__all__ = ["TORUS_MIN_TOKENS_PER_GPU", "torus_off", "tokens_per_gpu", "why_torus_off"]

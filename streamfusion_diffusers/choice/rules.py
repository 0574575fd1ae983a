"""Measured rules that overrule the cost model where it is known to be optimistic.

Torus inside one machine (issue 11, part 4). On one machine every Torus stage moves its chunk over NVLink in a
fraction of the attention it overlaps, so what Torus hides is small, while its fixed costs stay: T stage
launches, per-chunk layout copies, T x R attention calls instead of one, log-sum-exp merges, a barrier per
layer. The cost model counts none of these and ranks Torus a close second everywhere. Measured with
`streamfusion bench` (BENCHMARKS.md, 2026-11-22, H200, one layer unless said, per-GPU share = (image + text
tokens) / P):

| 1 x P, workload | tokens per GPU | Torus best | best of the others |
|---|---|---|---|
| 1 x 4, Flux 1024 px | 1,152 | 2.07 - 5.40 ms | 0.66 ms (usp U4R1) |
| 1 x 4, Flux 2048 px | 4,224 | 2.69 - 3.13 ms | 1.78 ms (usp U1R4) |
| 1 x 2, Flux 2048 px, whole step | 8,448 | 475.1 ms | 467.3 ms (usp U1R2) |
| 1 x 4, CogVideoX 49 frames | 13,317 | 21.46 ms | 21.06 ms (usp U1R4) |
| 1 x 4, Flux 4096 px | 16,512 | 23.30 ms | 23.22 ms (usp U1R4), a tie |

So on one machine Torus (T > 1) is a candidate only from TORUS_MIN_TOKENS_PER_GPU tokens per GPU, the smallest
share where it came within noise of the best; across machines it always is (there it hides slow transfers).
"""
from __future__ import annotations

from ..core.config import Layout
from .workloads import Workload

TORUS_MIN_TOKENS_PER_GPU = 16384


def tokens_per_gpu(w: Workload, world: int) -> float:
    return (w.tokens + w.text_tokens) / world


def torus_off(lay: Layout, w: Workload) -> bool:
    """Whether the one-machine Torus rule takes this layout out of the running for this shape."""
    return lay.machines == 1 and lay.torus > 1 and tokens_per_gpu(w, lay.world_size) < TORUS_MIN_TOKENS_PER_GPU


def why_torus_off(w: Workload, world: int) -> str:
    return (f"Torus left out: one machine, {tokens_per_gpu(w, world):.0f} tokens per GPU < "
            f"{TORUS_MIN_TOKENS_PER_GPU} (measured rule, choice/rules.py)")


__all__ = ["TORUS_MIN_TOKENS_PER_GPU", "torus_off", "tokens_per_gpu", "why_torus_off"]

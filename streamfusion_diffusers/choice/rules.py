"""Rules from measurements that overrule the cost model where it is known to be optimistic.

Torus inside one machine (issue 11, part 4). On one machine every Torus stage moves its chunk over NVLink in a
fraction of the attention it overlaps, so what Torus hides is small, while its fixed costs stay: T stage
launches, per-chunk layout copies, T x R attention calls instead of one, log-sum-exp merges, a barrier per
layer. The cost model counts none of these and ranks Torus a close second everywhere.

Where the rule comes from (issue 34): the one-machine records are `streamfusion tune` on 1 x 2 H200
(2026-11-23, `bash benchmarks/tune_suite.sh`; the layer timings are `recipes/measurements.json`, the log
`benchmarks/results/2026-11-23-h200x2/tune-1x2-real.log`). At every share they hold Torus (U2R1T2) lost to the
best other layout, by less as the share grows (ms per layer, NCCL):

| workload on 1 x 2 | tokens per GPU | Torus U2R1T2 | best other |
|---|---:|---:|---:|
| Flux 1024 px | 2,304 | 1.184 | 0.586 (tas U1R2) |
| Flux 2048 px | 8,448 | 3.531 | 3.155 (torus U1R2, a ring) |
| Flux 3072 px | 18,688 | 15.97 | 15.13 (ring U1R2) |
| CogVideoX 49 frames 768 x 1360 | 26,633 | 43.04 | 41.84 (torus U1R2) |
| Flux 4096 px | 33,024 | 48.83 | 45.82 (torus U1R2) |
| CogVideoX 161 frames 768 x 1360 | 83,753 | 402.8 | 397.0 (ring U1R2), +1.5% |

(NVSHMEM alike: +2.1%, +4.7% and +2.0% at Flux 2048, 4096 and CogVideoX 49.) So on one machine Torus (T > 1)
is a candidate only above the largest share at which it was recorded losing: TORUS_MIN_TOKENS_PER_GPU, which
tests/test_torus_rule.py derives from measurements.json again. Beyond it nothing was measured and the cost model
decides; across machines Torus always is a candidate (there it hides slow transfers). A recipe entry that
`streamfusion tune` measures on your machine comes before this rule.

No 1 x 4 or 1 x 8 record is kept. An earlier version of this note quoted 1 x 4 layer timings (H200, 2026-11-22)
and set the threshold at 16,384 tokens per GPU from them; they come from hand-written session notes outside this
repository (the device notes, "Turn-2 measurements"), with no raw output or exact command, so they are not a
record. They said the same as the records above: Torus never faster on one machine (behind at 1,152 to 13,317
tokens per GPU, level with the best at 16,512).
"""
from __future__ import annotations

from ..core.config import Layout
from .workloads import Workload

TORUS_MIN_TOKENS_PER_GPU = 83_754  # CogVideoX-5b 161 frames on 1 x 2 (167,506 tokens): the last share Torus lost


def tokens_per_gpu(w: Workload, world: int) -> float:
    return (w.tokens + w.text_tokens) / world


def torus_off(lay: Layout, w: Workload) -> bool:
    """Whether the one-machine Torus rule takes this layout out of the running for this shape."""
    return lay.machines == 1 and lay.torus > 1 and tokens_per_gpu(w, lay.world_size) < TORUS_MIN_TOKENS_PER_GPU


def why_torus_off(w: Workload, world: int) -> str:
    return (f"Torus left out: one machine, {tokens_per_gpu(w, world):.0f} tokens per GPU < "
            f"{TORUS_MIN_TOKENS_PER_GPU} (below it Torus lost at every share measured on 1 x 2: choice/rules.py)")


__all__ = ["TORUS_MIN_TOKENS_PER_GPU", "torus_off", "tokens_per_gpu", "why_torus_off"]

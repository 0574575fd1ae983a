"""The figures BENCHMARKS.md quotes, computed from the records under benchmarks/results/ so that they cannot drift.

`python benchmarks/figures.py` prints each figure, the phrase BENCHMARKS.md says it in and the records it comes from;
tests/test_figures.py checks that BENCHMARKS.md holds every phrase. CPU only, reads JSON, no GPU.

Kernel ranges: cuDNN + LSE time / `kernel="fused"` time (medians of CUDA-graph replays, `benchmarks/kernel_table.py`)
over every kernel-table record taken with the Gluon kernel (the one `kernel="fused"` runs on Hopper), per group of
shares: the smallest share, where a launch's fixed cost weighs most; Flux 2048 and 4096 px at head dim 128;
CogVideoX at head dim 64.
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GLUON = "streamfusion_diffusers.kernels.gluon_attention"  # the records' `fused_kernel`
GROUPS = {  # BENCHMARKS.md's words for a group of shares -> the kernel table's share names
    "at the smallest share (Flux 1024 px on 8 GPUs)": ("flux1024/P8",),
    "at Flux 2048-4096 px on 2 GPUs (head dim 128)": ("flux2048/P2", "flux4096/P2"),
    "at head dim 64 (CogVideoX)": ("cogvideox49-480x720/P2",),
}


def kernel_records() -> list[Path]:
    """Every kernel-table record of the shares (not of `--set p1`) with the Gluon kernel, in date order of folders."""
    shares = {s for group in GROUPS.values() for s in group}
    records = [(p, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*/kernel_table*.json"))]
    return [p for p, r in records if r.get("fused_kernel") == GLUON and shares & {row["share"] for row in r["rows"]}]


def fused_ratios(record: Path) -> dict[str, float]:
    """Share -> cuDNN + LSE / fused, medians."""
    rows = json.loads(record.read_text())["rows"]
    return {r["share"]: r["ms"]["cudnn+lse"]["median"] / r["ms"]["ours fused"]["median"] for r in rows}


def kernel_ranges() -> dict[str, tuple[float, float]]:
    """BENCHMARKS.md's words for each group -> (lowest, highest) ratio over every record and share of the group."""
    ratios = [fused_ratios(p) for p in kernel_records()]
    return {words: (min(r[s] for r in ratios for s in shares), max(r[s] for r in ratios for s in shares))
            for words, shares in GROUPS.items()}


def kernel_phrase() -> str:
    """What BENCHMARKS.md says of the fused kernel against cuDNN + LSE, from the records."""
    parts = [f"{lo:.2f}-{hi:.2f}x {words}" for words, (lo, hi) in kernel_ranges().items()]
    parts[0] = parts[0].replace("x ", "x cuDNN + LSE ", 1)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def phrases() -> list[str]:
    """Every phrase BENCHMARKS.md must hold, as computed here."""
    return [kernel_phrase()]


def main() -> None:
    for path in kernel_records():
        ratios = fused_ratios(path)
        print(f"{path.relative_to(RESULTS.parent.parent)}: " + ", ".join(f"{s} {r:.3f}" for s, r in ratios.items()))
    for phrase in phrases():
        print(f"BENCHMARKS.md: {phrase}")


if __name__ == "__main__":
    main()

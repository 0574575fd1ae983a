"""Whole-generation results as a table per workload (seconds per phase, speed-ups over each baseline), one line
per baseline with the per-phase ratios of our fastest system, and results.json."""
from __future__ import annotations

import json
from pathlib import Path

from ..runtime.phases import PHASES

BASELINES = ("one-gpu", "diffusers-cp", "xfuser")
SHORT = {"text_encoding": "text", "denoising": "denoise", "decode": "decode", "total": "total"}


def _total(row: dict) -> float:
    return row["phases"]["total"]["median"]


def fastest(rows: list[dict], systems: tuple[str, ...]) -> dict | None:
    mine = [r for r in rows if r["system"] in systems]
    return min(mine, key=_total) if mine else None


def _workloads(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["workload"] for r in rows))


def markdown(rows: list[dict], title: str) -> str:
    """Per workload, one line per system: median seconds per phase, the total's min - max, the total's speed-up
    over one GPU and over the best row of the workload's other baseline, the error against one GPU."""
    out = [f"## {title}", ""]
    for workload in _workloads(rows):
        mine = [r for r in rows if r["workload"] == workload]
        base = {b: fastest(mine, (b,)) for b in BASELINES}
        others = [b for b in BASELINES[1:] if base[b] is not None]
        head = " | ".join(f"{SHORT[p]} s" for p in PHASES)
        vs = "".join(f" x {b} |" for b in ["one-gpu", *others] if base[b] is not None)
        out += [f"### {workload}", "", f"| system | layout | {head} | total min - max |{vs} rel err | peak GiB |",
                "|---|---|" + "---:|" * (len(PHASES) + 3 + vs.count("|"))]
        for r in mine:
            ph = r["phases"]
            cells = " | ".join(f"{ph[p]['median']:.3f}" for p in PHASES)
            ratios = "".join(f" {_total(base[b]) / _total(r):.2f} |" for b in ["one-gpu", *others]
                             if base[b] is not None)
            err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
            peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            out.append(f"| {r['case']} | {r['layout']} | {cells} | {ph['total']['min']:.3f} - "
                       f"{ph['total']['max']:.3f} |{ratios} {err} | {peak} |")
        out.append("")
    return "\n".join(out)


def summary(rows: list[dict], ours: tuple[str, ...]) -> list[str]:
    """Per workload and baseline: our fastest system against the baseline's fastest row, phase by phase
    (baseline seconds / ours: above 1 is faster)."""
    lines = []
    for workload in _workloads(rows):
        mine = [r for r in rows if r["workload"] == workload]
        best = fastest(mine, ours)
        for b in BASELINES:
            base = fastest(mine, (b,))
            if best is None or base is None:
                continue
            ratios = ", ".join(f"{SHORT[p]} {base['phases'][p]['median'] / max(best['phases'][p]['median'], 1e-9):.2f}x"
                               for p in PHASES)
            lines.append(f"{workload}: {best['case']} ({best['layout']}) {_total(best):.3f} s vs {base['case']} "
                         f"{_total(base):.3f} s: {ratios}")
    return lines


def write(rows: list[dict], setup: dict, notes: list[str], lines: list[str], out: Path, title: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "table.md"]
    paths[0].write_text(json.dumps({"setup": setup, "rows": rows, "notes": notes, "summary": lines}, indent=2))
    paths[1].write_text(markdown(rows, title) + "\n" + "\n".join(lines) + "\n")
    return paths


__all__ = ["BASELINES", "fastest", "markdown", "summary", "write"]

"""Benchmark results as a markdown table, a JSON file and a PNG plot (ratios to the larger of the
no-communication bound and, over an emulated link, the link bound)."""
from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

from ..commands.timing import SPREAD_LIMIT
from ..core.extras import install_hint

logger = logging.getLogger(__name__)

BASELINE = {"layer": "xdit-usp", "block": "diffusers-cp", "step": "diffusers-cp"}  # what each level compares to


def best_rows(rows: list[dict]) -> list[dict]:
    """Each (workload, level, method)'s fastest layout, in first-seen order."""
    best: dict[tuple[str, str, str], dict] = {}
    for row in rows:
        key = (row["workload"], row["level"], row["method"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    return list(best.values())


def _range(row: dict) -> str:
    return f"{row['min_ms']:.3f} - {row['max_ms']:.3f}" if row.get("min_ms") is not None else "-"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _link(row: dict) -> str:
    return f"{row['link_bound_ms']:.3f}" if row.get("link_bound_ms") is not None else "-"


def _calls(row: dict) -> str:
    return str(row["calls"]) if row.get("calls") is not None else "-"


def _spread(row: dict) -> str:
    spread = row.get("spread")
    if spread is None:
        return "-"
    return f"{100 * spread:.1f}%" + (" !" if spread > SPREAD_LIMIT else "")


def noisy(rows: list[dict]) -> list[str]:
    """One line per row whose repetitions spread more than SPREAD_LIMIT around the median."""
    return [f"{r['workload']} {r['level']} {r['layout']}: min {r['min_ms']:.3f} / median {r['ms']:.3f} / max "
            f"{r['max_ms']:.3f} ms, a spread of {100 * r['spread']:.1f}% (> {100 * SPREAD_LIMIT:.0f}%): compare it "
            f"with care, or raise --iters" for r in rows if r.get("spread") is not None and r["spread"] > SPREAD_LIMIT]


def auto_summary(rows: list[dict], within: float = 0.02) -> list[str]:
    """Per workload and level with an "auto" row: PASS when auto's time is within `within` of the fastest other
    row of the same job (our layouts and the baselines), with the gap to the level's baseline as well."""
    lines = []
    for key in dict.fromkeys((r["workload"], r["level"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["level"]) == key and r["method"] != "bound"]
        auto = next((r for r in mine if r["method"] == "auto"), None)
        others = [r for r in mine if r["method"] != "auto"]
        if auto is None or not others:
            continue
        fastest = min(others, key=lambda r: r["ms"])
        gap = auto["ms"] / fastest["ms"] - 1
        base = [r for r in others if r["method"] == BASELINE[key[1]]]
        vs_base = ""
        if base:
            best_base = min(base, key=lambda r: r["ms"])
            gap_base = auto["ms"] / best_base["ms"] - 1
            vs_base = f"; {best_base['layout']} {best_base['ms']:.3f} ms ({100 * gap_base:+.1f}%)"
        lines.append(f"{'PASS' if gap <= within else 'FAIL'} {key[0]} {key[1]}: {auto['layout']} {auto['ms']:.3f} ms; "
                     f"fastest other {fastest['layout']} {fastest['ms']:.3f} ms ({100 * gap:+.1f}%){vs_base}")
    return lines


def markdown(rows: list[dict], header: str) -> str:
    """One line per row; "ms" is the median per call, "spread" (max - min) / median, flagged "!" above
    SPREAD_LIMIT; "calls" the back-to-back calls each sample timed; "link ms" the link bound (bench/bound.py);
    "x bound" the row's time over the larger of the no-comm bound and the link bound; "x <baseline>" is the
    level's baseline (best layout) time over the row's."""
    levels = list(dict.fromkeys(r["level"] for r in rows))
    baselines = "/".join(dict.fromkeys(BASELINE[level] for level in levels))
    lines = [header, "", f"| workload | level | method | layout | ms | min - max | spread | calls | link ms | "
             f"x bound | x {baselines} | max abs err | rel err | peak GiB |", "|---|---|---|---|" + "---:|" * 10]
    base = {(r["workload"], r["level"]): r["ms"] for r in best_rows(rows) if r["method"] == BASELINE[r["level"]]}
    for r in rows:
        key = (r["workload"], r["level"])
        speedup = f"{base[key] / r['ms']:.2f}" if key in base else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(f"| {r['workload']} | {r['level']} | {r['method']} | {r['layout']} | {r['ms']:.3f} | "
                     f"{_range(r)} | {_spread(r)} | {_calls(r)} | {_link(r)} | {_ratio(r['vs_bound'])} | {speedup} | "
                     f"{_err(r['max_abs_err'])} | {_err(r['rel_err'])} | {peak} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Grouped bars of each method's best time over its larger bound, per workload and level; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (%s): no plot written", install_hint("bench"))
        return False
    best = [r for r in best_rows(rows) if r["method"] != "bound"]
    groups = list(dict.fromkeys((r["workload"], r["level"]) for r in best))
    methods = list(dict.fromkeys(r["method"] for r in best))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    for i, method in enumerate(methods):
        values = {(r["workload"], r["level"]): r["vs_bound"] for r in best  # None: a workload run without a bound
                  if r["method"] == method and r["vs_bound"] is not None}
        xs = [j + i * width for j, g in enumerate(groups) if g in values]
        ax.bar(xs, [values[g] for g in groups if g in values], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(groups))],
                  [f"{w}\n{level}" for w, level in groups], fontsize=8)
    ax.set_ylabel("time / max(no-comm bound, link bound)")
    ax.set_title("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(rows: list[dict], setup: dict, out_dir: Path, title: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "table.md", "plot": out_dir / "plot.png"}
    paths["json"].write_text(json.dumps({"setup": setup, "rows": rows}, indent=2))
    paths["markdown"].write_text(markdown(rows, f"## {title}"))
    if not plot(rows, paths["plot"], title):
        del paths["plot"]
    return paths

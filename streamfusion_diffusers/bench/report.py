"""Benchmark results as a markdown table, a JSON file and a PNG plot (ratios to the no-communication bound)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def best_rows(rows: list[dict]) -> list[dict]:
    """Each (workload, method)'s fastest layout, in first-seen order."""
    best: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["workload"], row["method"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    return list(best.values())


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| workload | method | layout | ms | x bound | x xdit-usp | max abs err | peak GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    xdit = {r["workload"]: r["ms"] for r in best_rows(rows) if r["method"] == "xdit-usp"}
    for r in rows:
        speedup = f"{xdit[r['workload']] / r['ms']:.2f}" if r["workload"] in xdit else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        lines.append(f"| {r['workload']} | {r['method']} | {r['layout']} | {r['ms']:.3f} | {r['vs_bound']:.2f} | "
                     f"{speedup} | {r['max_abs_err']:.1e} | {peak} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Grouped bars of each method's best time over the bound, per workload; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'streamfusion-diffusers[bench]'): no plot written")
        return False
    best = [r for r in best_rows(rows) if r["method"] != "bound"]
    workloads = list(dict.fromkeys(r["workload"] for r in best))
    methods = list(dict.fromkeys(r["method"] for r in best))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4))
    for i, method in enumerate(methods):
        values = {r["workload"]: r["vs_bound"] for r in best if r["method"] == method}
        xs = [j + i * width for j, w in enumerate(workloads) if w in values]
        ax.bar(xs, [values[w] for w in workloads if w in values], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(workloads))], workloads, fontsize=8)
    ax.set_ylabel("time / no-communication bound")
    ax.set_title(title, fontsize=9)
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

"""The cost model against measurements: a markdown table of predicted vs measured layer times, before and after
fitting it (choice/calibrate.py), from `streamfusion tune`'s measurements.json or `streamfusion bench`'s
results.json (layer level), for BENCHMARKS.md. `streamfusion tune --report FILE...` prints it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..core.config import layout_label
from .calibrate import fit, predicted_ms
from .choose import gpu_of
from .costmodel import Gpu

BenchReader = Callable[[dict], list[dict]]  # a bench results.json -> tune's records


def load_records(paths: list[str], read_bench: BenchReader | None = None) -> list[dict]:
    """Records from tune's measurements.json files and bench's results.json files (or folders holding one).
    read_bench turns a results.json into records (the bench command's `records_from_bench`: only the command
    that wrote the file can read its recorded command line back)."""
    records = []
    for path in map(Path, paths):
        for name in ("measurements.json", "results.json"):
            if path.is_dir() and (path / name).is_file():
                path = path / name
        if not path.is_file():
            raise ValueError(f"{path}: no such file; give tune's measurements.json or bench's results.json")
        data = json.loads(path.read_text())
        if "records" not in data and read_bench is None:
            raise ValueError(f"{path}: a bench results.json; read it with `streamfusion tune --report`")
        records += data["records"] if "records" in data else read_bench(data)
    return records


def _err(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%"


def table(records: list[dict]) -> str:
    """Per device: the calibration fitted on its records, then one row per timed layout."""
    lines = []
    for device in dict.fromkeys(r["device"] for r in records):
        mine = [r for r in records if r["device"] == device]
        calibration = fit(mine)
        fitted = gpu_of(calibration)
        shown = {k: v for k, v in calibration.items() if k not in ("fitted_on", "max_error")}
        lines += [f"### Cost model vs measured, {device} ({calibration.get('fitted_on', 'no layouts')})", "",
                  f"Fitted: {', '.join(f'{k} {v}' for k, v in shown.items())}; largest error after "
                  f"{100 * calibration.get('max_error', 0):.1f}%.", "",
                  "| cluster | link | backend | workload | layout | measured ms | predicted | error | fitted | error |",
                  "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
        for r in mine:
            if r["kind"] != "layer":
                continue
            before, after = predicted_ms(r, Gpu()), predicted_ms(r, fitted)
            layout = layout_label(r["method"], r["ulysses"], r["ring"], r["torus"])
            lines.append(f"| {r['machines']} x {r['gpus_per_machine']} | {r['link']} | {r['backend']} | "
                         f"{r.get('workload', r['tokens'])} | {layout} | {r['ms']:.3f} | {before:.3f} | "
                         f"{_err(before, r['ms'])} | {after:.3f} | {_err(after, r['ms'])} |")
        lines.append("")
    return "\n".join(lines)

"""The cost model against measurements: a markdown table of predicted vs measured layer times, before and after
fitting it (recipes/calibrate.py), from `streamfusion tune`'s measurements.json or `streamfusion bench`'s
results.json (layer level), for BENCHMARKS.md. `streamfusion tune --report FILE...` prints it.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from ..bench import command as bench
from ..bench.costmodel import Gpu
from ..config import METHODS, layout_label
from ..verify import DTYPES
from .calibrate import fit, predicted_ms
from .choose import REAL_LINK, gpu_of

LAYOUT = re.compile(r"\w+ U(\d+)R(\d+)(?:T(\d+))?")


def records_from_bench(results: dict) -> list[dict]:
    """tune's records (bound and our layouts, layer level) from one bench results.json, read back from the
    command it records."""
    setup = results["setup"]
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(shlex.split(setup["command"])[2:])
    n = args.machines
    m = args.gpus_per_machine or setup["world"] // n
    workloads = {w.name: w for w in map(bench.parse_workload, bench.workload_specs(args.workloads))}
    elem = DTYPES[args.dtype or ("bfloat16" if setup["gpu"] else "float32")].itemsize
    out = []
    for r in results["rows"]:
        if r.get("level", "layer") != "layer" or r["method"] not in ("bound", *METHODS):
            continue
        w = workloads[r["workload"]]
        match = LAYOUT.fullmatch(r["layout"])
        u, ring, torus = (int(x) if x else None for x in match.groups()) if match else (1, 1, None)
        out.append({"device": setup["device"], "kind": "bound" if r["method"] == "bound" else "layer",
                    "machines": n, "gpus_per_machine": m, "link": args.emulate_link or REAL_LINK,
                    "backend": args.backend, "workload": w.name, "tokens": r["tokens"], "heads": w.heads,
                    "head_dim": w.head_dim, "batch": w.batch, "method": r["method"], "ulysses": u, "ring": ring,
                    "torus": torus, "min_ms": r.get("min_ms"), "ms": r["ms"], "max_ms": r.get("max_ms"),
                    "predicted_ms": None, "elem_bytes": elem})
    return out


def load_records(paths: list[str]) -> list[dict]:
    """Records from tune's measurements.json files and bench's results.json files (or folders holding one)."""
    records = []
    for path in map(Path, paths):
        for name in ("measurements.json", "results.json"):
            if path.is_dir() and (path / name).is_file():
                path = path / name
        if not path.is_file():
            raise ValueError(f"{path}: no such file; give tune's measurements.json or bench's results.json")
        data = json.loads(path.read_text())
        records += data["records"] if "records" in data else records_from_bench(data)
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

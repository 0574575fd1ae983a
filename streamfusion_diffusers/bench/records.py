"""A bench results.json read back as `streamfusion tune`'s records (layer level), for the cost model's calibration
(choice/predictions.py, choice/calibrate.py): the layouts timed, their shapes and cluster, from the bench
command line the file records.
"""
from __future__ import annotations

import argparse
import re
import shlex

from ..choice.choose import REAL_LINK
from ..choice.workloads import parse_workload, workload_specs
from ..commands.verify import DTYPES
from ..core.config import METHODS
from . import command as bench

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
    workloads = {w.name: w for w in map(parse_workload, workload_specs(args.workloads))}
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

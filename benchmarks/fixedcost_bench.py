"""Issue 11 in one job on 1 x P GPUs: what the fixed cost of a layer and of a step comes to, and what CUDA graphs,
TokenWeave waves and torch.compile take off it, beside xDiT's USP, diffusers' context parallelism and the bound.

    python3 -m streamfusion_diffusers launch --nproc-per-node 2 --recipe flux-dev --resolution 2048 \
        benchmarks/fixedcost_bench.py --out "$OUT/fixedcost"

(a) One Flux attention layer at 1024 and 2048 px (`streamfusion bench` layer level: every layout of ours eager
    and replayed from a CUDA graph, xDiT's USP, the no-communication bound; repetitions interleaved).
(b) One whole Flux.1-dev step at 2048 px (real config, random weights, bf16; `streamfusion bench` step level):
    the bound (eager, CUDA graph, compiled), ours eager / +cuda-graph / +waves2 / +compile at the step layouts,
    diffusers' context parallelism.
Every row is checked against the unparallelized model or exact attention, as `streamfusion bench` does. Prints
the bench table and a ratio table with the issue's bars (rank 0); writes table.md, results.json, plot.png and
ratios.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from streamfusion_diffusers.bench import report, xdit
from streamfusion_diffusers.bench.command import _cases as bench_cases
from streamfusion_diffusers.bench.command import _ok, parse_workload, run_tasks
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer
from streamfusion_diffusers.bench.model import ModelSetup, bench_model
from streamfusion_diffusers.bench.variants import VARIANTS, with_variants
from streamfusion_diffusers.bench.workloads import transformer_config
from streamfusion_diffusers.spawn import job_shape, run_job

OURS = ("ulysses", "usp", "tas", "torus")
# the bars: (level, workload px, what, limit); "bound": ours / bound <= limit; baseline: ours / it <= limit
BARS = [("layer", 1024, "xdit-usp", 0.80), ("layer", 2048, "bound", 1.15), ("layer", 2048, "xdit-usp", 0.90),
        ("step", 2048, "bound", 1.04), ("step", 2048, "diffusers-cp", 1 / 1.15)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "outputs"), "fixedcost"))
    p.add_argument("--backend", default="torch", help="our transport: torch (NCCL) or nvshmem")
    p.add_argument("--layer-sizes", default="1024,2048", help="Flux sides of the layer level (px)")
    p.add_argument("--step-size", type=int, default=2048, help="Flux side of the step level (px); 0 skips it")
    p.add_argument("--step-layouts", default=None,
                   help="ours at step level, METHOD:UxRy[Tz] comma-separated (default: usp U1R{P} and ulysses "
                        "U{P}R1, the measured best and the one waves overlap)")
    p.add_argument("--step-variants", default=",".join(VARIANTS))
    p.add_argument("--cp-layouts", default=None, help="diffusers-cp layouts (default U{P}R1, its measured best)")
    p.add_argument("--no-xdit", action="store_true", help="leave xDiT's USP out (yunchang not installed)")
    p.add_argument("--layer-iters", type=int, default=30)
    p.add_argument("--step-iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take")
    p.add_argument("--cpu", action="store_true", help="a smoke run of this script: 2 gloo processes, tiny Flux, "
                   "float32, no CUDA graphs, no xDiT, no diffusers-cp")
    return p.parse_args()


def _pick(method: str, layouts: str, p: int, heads: int, dtype: torch.dtype) -> list[Case]:
    return bench_cases(method, layouts, 1, p, heads, dtype != torch.float32, dtype)


def tasks(args: argparse.Namespace, p: int) -> list:
    dtype = torch.float32 if args.cpu else torch.bfloat16
    graph = () if args.cpu else ("cuda-graph",)
    out = []
    for side in (int(s) for s in args.layer_sizes.split(",") if s):
        w = parse_workload(f"flux-dev:{side}")
        setup = Setup(w, 1, p, args.backend, None, dtype, args.layer_iters, 5, 0, args.timeout)
        cases = [Case("bound")] + [c for m in OURS for c in _pick(m, "best", p, w.heads, dtype)]
        cases += [] if args.no_xdit or args.cpu else _pick("xdit-usp", "best", p, w.heads, dtype)
        out.append((bench_layer, setup, with_variants(cases, ("eager", *graph), ("layer",))))
    if args.step_size:
        w = parse_workload(f"flux-dev:{args.step_size}")
        config = transformer_config(w, "tiny" if args.cpu else "real")
        setup = Setup(w, 1, p, args.backend, None, dtype, args.step_iters, args.warmup, 0, args.timeout)
        ours = [c for spec in (args.step_layouts or f"usp:U1R{p},ulysses:U{p}R1").split(",")
                for c in _pick(spec.split(":")[0], spec.split(":")[1], p, w.heads, dtype)]
        cp = [] if args.cpu else _pick("diffusers-cp", args.cp_layouts or f"U{p}R1", p, w.heads, dtype)
        wanted = (v.strip() for v in args.step_variants.split(","))
        variants = tuple(v for v in wanted if v and (v in graph or v != "cuda-graph"))
        out.append((bench_model, ModelSetup(setup, config, ("step",)),
                    with_variants([Case("bound")] + ours, variants, ("step",)) + cp))
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per workload and level: the bound, the best baseline, ours best per variant, and the issue's bars."""
    lines = []
    for key in dict.fromkeys((r["workload"], r["level"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["level"]) == key]
        bound = next(r["ms"] for r in mine if r["method"] == "bound")
        base_name = report.BASELINE[key[1]]
        base = min((r["ms"] for r in mine if r["method"] == base_name), default=None)
        for variant in ["eager"] + [v for v in VARIANTS if v != "eager"]:
            rows_v = [r for r in mine if r["method"].split("+")[0] in OURS
                      and (r["method"].partition("+")[2] or "eager") == variant]
            if not rows_v:
                continue
            best = min(rows_v, key=lambda r: r["ms"])
            own = next((r["ms"] for r in mine if r["method"] == f"bound+{variant}"), bound)  # equally helped bound
            side = int(key[0].split()[1].split("x")[0])
            bars = []
            for level, px, what, limit in BARS:
                ref = bound if what == "bound" else base
                if (level, px) == (key[1], side) and ref:
                    ratio = best["ms"] / ref
                    bars.append(f"{'PASS' if ratio <= limit else 'FAIL'} /{what} {ratio:.2f} <= {limit:.2f}")
            lines.append(dict(workload=key[0], level=key[1], variant=variant, layout=best["layout"],
                              ms=best["ms"], bound_ms=bound, vs_bound=best["ms"] / bound, vs_own_bound=best["ms"] / own,
                              baseline=base_name, baseline_ms=base, vs_baseline=best["ms"] / base if base else None,
                              bars="; ".join(bars)))
    return lines


def ratio_table(lines: list[dict]) -> str:
    out = ["| workload | level | ours variant | best layout | ms | x bound | x bound same variant | baseline ms | "
           "x baseline | bars |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in lines:
        base = f"{r['baseline']} {r['baseline_ms']:.3f}" if r["baseline_ms"] else "-"
        vs = f"{r['vs_baseline']:.2f}" if r["vs_baseline"] else "-"
        out.append(f"| {r['workload']} | {r['level']} | {r['variant']} | {r['layout']} | {r['ms']:.3f} | "
                   f"{r['vs_bound']:.2f} | {r['vs_own_bound']:.2f} | {base} | {vs} | {r['bars']} |")
    return "\n".join(out)


def main() -> int:
    args = parse_args()
    if not (args.no_xdit or args.cpu or xdit.available()):
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"fixedcost_bench: xDiT's USP left out ({xdit.INSTALL_HINT})")
        args.no_xdit = True
    world, gpu = job_shape(2, args.cpu)
    if not gpu and not args.cpu:
        raise SystemExit("fixedcost_bench needs GPUs: run it under streamfusion launch / torchrun on a GPU host "
                         "(or --cpu for a smoke run)")
    rows = run_job(run_tasks, world, tasks(args, world), gpu=gpu, timeout_s=1800)[0]
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    for row in rows:
        row["ok"] = _ok(row, torch.bfloat16 if gpu else torch.float32)
    lines = ratios(rows)
    device = torch.cuda.get_device_name() if gpu else "CPU processes"
    title = (f"Issue 11: fixed costs, 1 x {world} {device}, {'bf16' if gpu else 'float32'}, {args.backend}; layer: "
             f"min / median / max of {args.layer_iters} interleaved; step: {args.step_iters} after {args.warmup} "
             f"warm-up")
    out = Path(args.out)
    report.write(rows, {"world": world, "device": device, "args": vars(args)}, out, title)
    (out / "ratios.json").write_text(json.dumps(lines, indent=2))
    print(report.markdown(rows, f"## {title}"))
    print(ratio_table(lines))
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"MISMATCH: {r['workload']} {r['level']} {r['layout']} abs {r['max_abs_err']} rel {r['rel_err']}")
    print(f"wrote {out}/table.md, results.json, ratios.json")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

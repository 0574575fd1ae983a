"""`streamfusion bench`: time one attention layer for every method and layout side by side, in one job.

Methods: ours (ulysses, ring, usp, tas, torus, on the chosen backend, optionally over an emulated slow link),
xDiT's USP ("xdit-usp", through yunchang) and the no-communication bound. Spawns a local job (gloo on the
CPU, NCCL with a GPU per process) or joins the torchrun job it runs in. Writes table.md, results.json and
plot.png under --out.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
from pathlib import Path

import torch

from ..config import METHODS, ParallelConfig, resolve_layout
from ..links import parse_link
from ..spawn import job_shape, run_job
from ..verify import DTYPES, TOLERANCE
from . import report, xdit
from .costmodel import candidate_layouts
from .layer import Case, Setup, bench_layer, padded_length
from .workloads import MODELS, Workload

BASELINES = ("xdit-usp",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="flux-dev:2048",
                        help="comma-separated: flux-dev:RESOLUTION, cogvideox-5b:FRAMES, or "
                             "custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM (default flux-dev:2048)")
    parser.add_argument("--methods", default="ulysses,usp,tas,torus,xdit-usp",
                        help=f"comma-separated from {', '.join(METHODS + BASELINES)}; the bound is always timed")
    parser.add_argument("--layouts", default="best",
                        help="'best' (time every UxR, report each method's fastest), 'all', or a list like "
                             "U8R1,U4R2,U4R2T2")
    parser.add_argument("--machines", type=int, default=1, help="machines N (virtual ones with --emulate-link)")
    parser.add_argument("--gpus-per-machine", type=int, default=None, help="default: world size / N (8 locally)")
    parser.add_argument("--backend", default="torch", help="transport of our methods: torch or nvshmem")
    parser.add_argument("--emulate-link", default=None, help="slow the inter-machine link: dgx, p4de, p5 or GBPS:US")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on GPU, else float32")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one case may take before the job prints every stack and exits (default 300)")
    parser.add_argument("--out", default=None, help="output folder (default outputs/bench-<time>)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--cpu", action="store_true", help="spawn gloo processes on the CPU even if GPUs exist")


def parse_workload(spec: str) -> Workload:
    name, *params = spec.split(":")
    try:
        values = [int(p) for p in params]
    except ValueError:
        raise ValueError(f"workload {spec!r}: the numbers after the model name must be integers") from None
    if name == "custom" and len(values) == 4:
        tokens, text, heads, head_dim = values
        return Workload(f"custom {tokens}+{text}", tokens, text, heads, head_dim, blocks=1)
    if name in MODELS and len(values) <= 1:
        return MODELS[name](*values)
    raise ValueError(f"workload {spec!r}: use flux-dev:RESOLUTION, cogvideox-5b:FRAMES or "
                     f"custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM")


def _cases(method: str, layouts: str, n: int, m: int, heads: int, gpu: bool) -> list[Case]:
    p = n * m
    if method == "xdit-usp":
        found = [Case(method, u, p // u) for u in range(1, p + 1) if p % u == 0 and heads % u == 0
                 and (gpu or u == p)]  # yunchang's ring runs only on CUDA
    else:
        found = [Case(method, lay.ulysses, lay.ring, lay.torus if method == "torus" else None)
                 for lay in candidate_layouts(method, n, m, heads)]
    if layouts in ("best", "all"):
        return found
    wanted = set()
    for spec in layouts.split(","):
        match = re.fullmatch(r"U(\d+)R(\d+)(?:T(\d+))?", spec.strip())
        if not match:
            raise ValueError(f"layout {spec!r} is not like U4R2 or U4R2T2")
        u, r, t = (int(x) if x else None for x in match.groups())
        wanted.add((u, r, t if method == "torus" else None))
    return [c for c in found if (c.ulysses, c.ring, c.torus) in wanted]


def main(args: argparse.Namespace) -> int:
    world, gpu = job_shape(args.machines * (args.gpus_per_machine or 8), args.cpu)
    m = args.gpus_per_machine or world // args.machines
    workloads = [parse_workload(s) for s in args.workloads.split(",") if s.strip()]
    methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    unknown = sorted(set(methods) - set(METHODS) - set(BASELINES))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS + BASELINES)}")
    if "xdit-usp" in methods and not xdit.available():
        raise ValueError(xdit.INSTALL_HINT)
    if args.emulate_link:
        parse_link(args.emulate_link)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    rows: list[dict] = []
    for w in workloads:
        resolve_layout(ParallelConfig(machines=args.machines, gpus_per_machine=m, method="usp"), world, w.heads)
        cases = [Case("bound")] + [c for meth in methods for c in _cases(meth, args.layouts, args.machines, m,
                                                                           w.heads, gpu)]
        setup = Setup(w, args.machines, m, args.backend, args.emulate_link, dtype, args.iters, args.warmup, args.seed,
                      args.timeout)
        rows += run_job(bench_layer, world, setup, cases, gpu=gpu)[0]
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    tol = TOLERANCE[dtype]
    for row in rows:
        row["ok"] = row["max_abs_err"] <= tol
    shown = rows if args.layouts != "best" else report.best_rows(rows)
    link = f", inter-machine link emulated as {parse_link(args.emulate_link).name}" if args.emulate_link else ""
    title = (f"One attention layer, {args.machines} x {m} {'GPUs' if gpu else 'CPU processes'}{link}, "
             f"{str(dtype).removeprefix('torch.')}, median of {args.iters} after {args.warmup} warm-up")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"outputs/bench-{stamp}")
    setup_info = {"command": "streamfusion bench " + " ".join(_argv(args)), "world": world, "gpu": gpu,
                  "device": torch.cuda.get_device_name() if gpu else "cpu", "date": stamp,
                  "tokens": {w.name: padded_length(w, world) for w in workloads}}
    paths = report.write(shown, setup_info, out, title)
    if args.json:
        print((out / "results.json").read_text())
    else:
        print(report.markdown(shown, f"## {title}"))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"MISMATCH: {r['workload']} {r['layout']} max abs error {r['max_abs_err']:.2e} > {tol:g}")
    return 1 if bad else 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if key in ("command", "verbose") or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out

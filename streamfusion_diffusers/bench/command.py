"""`streamfusion bench`: time every method and layout side by side, in one job, at up to three levels.

layer: one attention layer: ours (ulysses, ring, usp, tas, torus, on the chosen backend, optionally over an
emulated slow link), xDiT's USP ("xdit-usp", through yunchang) and the no-communication bound.
block / step: one transformer block and one whole denoising step of Flux or CogVideoX, built from its diffusers
config with random weights: ours through `parallelize`, diffusers' own context parallelism ("diffusers-cp",
GPUs only) and the bound.
e2e (on its own): whole generations against one GPU, diffusers-cp and xfuser (`bench/e2e.py`).
Spawns a local job (gloo on the CPU, NCCL with a GPU per process) or joins the torchrun job it runs in.
Writes table.md, results.json and plot.png under --out.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..choice.costmodel import candidate_layouts
from ..choice.workloads import Workload, parse_workload, transformer_config, workload_specs
from ..runtime.run import job_shape, run_job
from ..commands.timing import ITERS, SAMPLE_MS, WARMUP
from ..commands.verify import DTYPES
from ..core.config import DEFAULT_TIMEOUT_S, METHODS, ParallelConfig, resolve_layout
from ..core.exactness import LOWP_THRESHOLD, MODEL_THRESHOLD, threshold
from ..core.links import parse_link
from ..core.mesh import GroupCache
from ..models.pipelines import family_of
from . import e2e_command, report, variants, xdit
from .layer import Case, Setup, bench_layer, padded_length

logger = logging.getLogger(__name__)

LEVELS = ("layer", "block", "step", "e2e")
BASELINES = {"xdit-usp": ("layer",), "diffusers-cp": ("block", "step")}  # the levels each baseline runs at
WHAT = {"layer": "one attention layer", "block": "one transformer block", "step": "one denoising step"}
DIFFUSERS_CP_ON_CPU = ("diffusers-cp skipped: diffusers' enable_parallelism needs GPUs (it places rank r on "
                       "accelerator r % device_count, and there is none under gloo on the CPU)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="flux-dev:2048",
                        help="comma-separated: flux-dev:WIDTH[:HEIGHT], cogvideox-5b:FRAMES[:HEIGHT:WIDTH], or "
                             "custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM; a bare size repeats the model before it "
                             "(flux-dev:1024,2048); default flux-dev:2048")
    parser.add_argument("--level", default="layer",
                        help="comma-separated from layer (one attention layer), block (one transformer block), "
                             "step (one whole transformer forward); default layer; or e2e alone (whole generations: "
                             "text encoding, denoising, VAE decode, against one GPU, diffusers-cp and xfuser)")
    parser.add_argument("--model-size", choices=("real", "tiny"), default=None,
                        help="block/step/e2e levels: the model's real config or its tiny twin (default real on "
                             "GPUs, tiny on the CPU; custom workloads always build a tiny Flux of their heads)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated from {', '.join(METHODS + tuple(BASELINES))}, auto (default: all but "
                             f"ring and auto, with xdit-usp at layer level and diffusers-cp at block/step); the bound "
                             f"always runs; auto is the layout method='auto' chooses (see --recipe); e2e: from "
                             f"{', '.join(e2e_command.SYSTEMS)} (default all)")
    parser.add_argument("--recipe", default=None,
                        help="where method auto looks: a packaged recipe name, a YAML file or a folder of them "
                             "(e.g. the --out of streamfusion tune); default: the packaged recipes")
    parser.add_argument("--layouts", default="best",
                        help="'best' (time every UxR, report each method's fastest), 'all', or a list like "
                             "U8R1,U4R2,U4R2T2; e2e: the baselines' layouts, e.g. U2R1,xfuser:cfg2U1R1")
    parser.add_argument("--machines", type=int, default=1, help="machines N (virtual ones with --emulate-link)")
    parser.add_argument("--gpus-per-machine", type=int, default=None, help="default: world size / N (8 locally)")
    parser.add_argument("--backend", default="torch", help="transport of our methods: torch, symm-pull or nvshmem")
    parser.add_argument("--emulate-link", default=None, help="slow the inter-machine link: dgx, p4de, p5 or GBPS:US")
    parser.add_argument("--comm-dtype", choices=("int8", "fp8"), default=None,
                        help="send every inter-machine chunk (Torus Pull Q, Pull KV, Push O; ring passes) as 1-byte "
                             "values with per-token-and-head scales, int8 or fp8 (float8_e4m3fn) (checked against a "
                             f"relative error of {LOWP_THRESHOLD:g} instead of the exact tolerance)")
    parser.add_argument("--variants", default="eager",
                        help=f"comma-separated ways to run our layouts, each timed beside the others: "
                             f"{', '.join(variants.VARIANTS)} (cuda-graph at layer and step level; "
                             f"compile at block and step level; the bound also runs cuda-graph and compile); "
                             f"default eager")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on GPU, else float32")
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed samples per case, each at least {SAMPLE_MS:g} ms of back-to-back calls "
                             f"(default {ITERS}, as tune; e2e: 3 generations)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed rounds of every case first (default {WARMUP}, as tune; e2e: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one case may take before the job prints every stack and exits (default 300)")
    parser.add_argument("--out", default=None, help="output folder (default outputs/bench-<time>)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--cpu", action="store_true", help="spawn gloo processes on the CPU even if GPUs exist")
    e2e_command.add_arguments(parser)


def parse_levels(spec: str) -> tuple[str, ...]:
    levels = tuple(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    unknown = [x for x in levels if x not in LEVELS]
    if unknown or not levels:
        raise ValueError(f"unknown level(s) {unknown or [spec]} in --level; choose from {', '.join(LEVELS)} "
                         f"(comma-separated, e.g. --level block,step)")
    return tuple(x for x in LEVELS if x in levels)


def _methods(spec: str | None, levels: tuple[str, ...]) -> list[str]:
    if spec is None:
        return ["ulysses", "usp", "tas", "torus"] + [b for b, at in BASELINES.items() if set(at) & set(levels)]
    methods = [x.strip() for x in spec.split(",") if x.strip()]
    unknown = sorted(set(methods) - set(METHODS) - set(BASELINES) - {"auto"})
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS + tuple(BASELINES))}, auto")
    return methods


def _cases(method: str, layouts: str, n: int, m: int, heads: int, gpu: bool, dtype: torch.dtype) -> list[Case]:
    p = n * m
    if method == "auto":  # one case whatever --layouts says: the layout is its choice
        return [Case("auto")]
    if method in BASELINES:
        # rings need an attention that returns the log-sum-exp: yunchang's runs only on CUDA, and diffusers'
        # (cuDNN) only in half precision
        ring_ok = gpu if method == "xdit-usp" else dtype in (torch.float16, torch.bfloat16)
        found = [Case(method, u, p // u) for u in range(1, p + 1) if p % u == 0 and heads % u == 0
                 and (ring_ok or u == p)]
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


def _runs_at(method: str, level: str, w: Workload, config: dict[str, Any] | None, world: int, gpu: bool,
             notes: list[str]) -> bool:
    """Whether a method runs at a level for a workload; if not, says why in `notes` (once per reason)."""
    why = None
    if method in BASELINES and level not in BASELINES[method]:
        why = f"{method} skipped at {level} level: it runs at {' and '.join(BASELINES[method])} level only"
    elif method == "diffusers-cp" and not gpu:
        why = DIFFUSERS_CP_ON_CPU
    elif method == "diffusers-cp" and w.model and not family_of(w.model).diffusers_cp:
        why = (f"diffusers-cp skipped for {w.name}: diffusers has no context-parallel plan for CogVideoX (and its "
               f"attention processor does not go through the dispatcher that runs it)")
    elif method == "diffusers-cp" and (w.tokens % world or w.text_tokens % world):
        why = (f"diffusers-cp skipped for {w.name}: it needs the {w.tokens} image and {w.text_tokens} text tokens "
               f"each divisible by the {world} ranks")
    if why and why not in notes:
        notes.append(why)
    return why is None


def run_tasks(tasks: list[tuple[Callable[..., list[dict]], Any, list[Case]]]) -> list[dict]:
    """On every rank: each (benchmark, setup, cases) in turn, so a local job starts its processes once and
    creates each layout's process groups once."""
    groups = GroupCache()
    return [row for fn, setup, cases in tasks for row in fn(setup, cases, groups)]


def _lossy(row: dict, comm_dtype: str | None) -> bool:
    """Whether a row ran our methods over 1-byte transfers (the baselines and the bound never do)."""
    return comm_dtype is not None and row["method"].split("+")[0] not in (*BASELINES, "bound")


def limit(row: dict, dtype: torch.dtype, comm_dtype: str | None = None) -> float:
    """The relative error a row may show (exactness.py): our methods over 1-byte transfers by the lossy bound at
    every level (their rounding reaches block and step outputs too), else attention at layer level, a block or
    step against the unparallelized model in the same dtype."""
    if _lossy(row, comm_dtype):
        return LOWP_THRESHOLD
    return threshold(dtype) if row["level"] == "layer" else MODEL_THRESHOLD[dtype]


def _ok(row: dict, dtype: torch.dtype, comm_dtype: str | None = None) -> bool:
    return row["rel_err"] is None or row["rel_err"] <= limit(row, dtype, comm_dtype)  # None: not checked


def main(args: argparse.Namespace) -> int:
    world, gpu = job_shape(args.machines * (args.gpus_per_machine or 8), args.cpu)
    m = args.gpus_per_machine or world // args.machines
    levels = parse_levels(args.level)
    if "e2e" in levels:
        if len(levels) > 1:
            raise ValueError("--level e2e times whole generations in a table of its own: run it on its own")
        args.iters, args.warmup = args.iters or 3, 1 if args.warmup is None else args.warmup
        return e2e_command.run(args, _argv(args))
    args.iters, args.warmup = args.iters or ITERS, WARMUP if args.warmup is None else args.warmup
    workloads = [parse_workload(s) for s in workload_specs(args.workloads)]
    methods = _methods(args.methods, levels)
    ways = variants.parse_variants(args.variants)
    if "cuda-graph" in ways and not gpu:
        raise ValueError("--variants cuda-graph needs GPUs (an NCCL job); drop it from --variants on the CPU")
    if "layer" in levels and "xdit-usp" in methods and not xdit.available():
        raise ValueError(xdit.INSTALL_HINT)
    if args.emulate_link:
        parse_link(args.emulate_link)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    size = args.model_size or ("real" if gpu else "tiny")
    model_levels = tuple(x for x in levels if x != "layer")
    notes: list[str] = []
    tasks = []
    for w in workloads:
        setup = Setup(w, args.machines, m, args.backend, args.emulate_link, dtype, args.iters, args.warmup, args.seed,
                      args.timeout, args.recipe, args.comm_dtype)
        if "layer" in levels:
            resolve_layout(ParallelConfig(machines=args.machines, gpus_per_machine=m, method="usp"), world, w.heads)
            tasks.append((bench_layer, setup, variants.with_variants([Case("bound")] + [
                c for meth in methods if _runs_at(meth, "layer", w, None, world, gpu, notes)
                for c in _cases(meth, args.layouts, args.machines, m, w.heads, gpu, dtype)], ways, ("layer",))))
        if model_levels:
            from .model import PROCESSOR_FAMILIES, ModelSetup, bench_model, family  # imports diffusers

            bound = [Case("bound")] if family(w) in PROCESSOR_FAMILIES else []
            if not bound and "block" in model_levels:
                raise ValueError(f"{w.name}: the block level times Flux.1 and CogVideoX blocks; run the newer models "
                                 f"at --level step")
            if not bound and (why := f"bound skipped for {w.name}: it runs through the Flux and CogVideoX "
                                     f"processors") not in notes:
                notes.append(why)
            config = transformer_config(w, size)
            heads = config["num_attention_heads"]
            resolve_layout(ParallelConfig(machines=args.machines, gpus_per_machine=m, method="usp"), world, heads)
            ours = [c for meth in methods if _runs_at(meth, model_levels[0], w, config, world, gpu, notes)
                    for c in _cases(meth, args.layouts, args.machines, m, heads, gpu, dtype)]
            tasks.append((bench_model, ModelSetup(setup, config, model_levels),
                          variants.with_variants(bound + ours, ways, model_levels)))
    rank0 = int(os.environ.get("RANK", 0)) == 0
    for note in notes if rank0 else ():
        print(f"streamfusion bench: {note}", file=sys.stderr)
    timeout = DEFAULT_TIMEOUT_S
    if model_levels:  # real-size models outlast spawn's default job timeout; --timeout is per case
        timeout = max(timeout, args.timeout * (1 + sum(len(cases) + 1 for *_, cases in tasks)))
    rows = run_job(run_tasks, world, tasks, gpu=gpu, timeout_s=timeout)[0]
    if not rank0:
        return 0
    for row in rows:
        row["ok"] = _ok(row, dtype, args.comm_dtype)
    shown = rows if args.layouts != "best" else report.best_rows(rows)
    link = f", inter-machine link emulated as {parse_link(args.emulate_link).name}" if args.emulate_link else ""
    what = ", ".join(WHAT[x] for x in levels)
    model = f" ({size} transformers, random weights)" if model_levels else ""
    title = (f"{what[0].upper()}{what[1:]}{model}, {args.machines} x {m} {'GPUs' if gpu else 'CPU processes'}{link}, "
             f"{str(dtype).removeprefix('torch.')}, min / median / max per call of {args.iters} samples of >= "
             f"{SAMPLE_MS:g} ms after {args.warmup} warm-up"
             f"{' (layer: interleaved across cases)' if 'layer' in levels else ''}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"outputs/bench-{stamp}")
    setup_info = {"command": "streamfusion bench " + " ".join(_argv(args)), "world": world, "gpu": gpu,
                  "device": torch.cuda.get_device_name() if gpu else "cpu", "date": stamp, "levels": list(levels)}
    if "layer" in levels:
        setup_info["tokens"] = {w.name: padded_length(w, world) for w in workloads}
    if model_levels:
        setup_info["model_size"] = size
    paths = report.write(shown, setup_info, out, title)
    for line in report.noisy(shown):
        logger.warning("streamfusion bench: noisy case %s", line)
    summary = report.auto_summary(rows)
    if args.json:
        print((out / "results.json").read_text())
    else:
        print(report.markdown(shown, f"## {title}"))
        print("\n".join(summary))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        print(f"MISMATCH: {r['workload']} {r['level']} {r['layout']} relative error {r['rel_err']:.2e} > "
              f"{limit(r, dtype, args.comm_dtype):.1e}")
    return 1 if bad else 0


def _argv(args: argparse.Namespace) -> list[str]:
    out = []
    for key, value in vars(args).items():
        if key in ("command", "verbose") or value in (None, False):
            continue
        flag = "--" + key.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out

"""`streamfusion bench --level e2e`: whole generations of every `generate --model` (Flux.1, Flux.2, Qwen-Image,
Wan 2.2, CogVideoX), ours against one GPU, diffusers' context parallelism (all but CogVideoX), xfuser's pipeline
(CogVideoX) and Cache-DiT's parallelism (`bench/cachedit.py`), in one job; see `bench/e2e.py` for what each
system runs.

Which systems run where is settled here, before any process starts, and every skip is said once: the baselines
need GPUs (diffusers places rank r on accelerator r, xfuser refuses to import without one), diffusers has no
context-parallel plan for CogVideoX, and xfuser's pipeline is timed for CogVideoX (the workload it is the
reference for).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from ..choice.workloads import parse_workload, workload_specs
from ..runtime.arguments import DEFAULT_PROMPT
from ..runtime.job import guided
from ..core.config import DEFAULT_TIMEOUT_S
from ..runtime.run import job_shape, run_job
from ..commands.verify import DTYPES
from ..core.extras import install_hint
from ..core.links import parse_link
from ..models import MODELS, TINY
from ..models.pipelines import family_of
from . import cachedit, e2e_report

BASELINES = ("diffusers-cp", "xfuser", *cachedit.SYSTEMS)
SYSTEMS = ("one-gpu", "ours", "ours-no-vae-split", "ours-cfg", *BASELINES)
NO_GPU = "{} skipped: it needs GPUs ({}); run the job under torchrun on GPUs to time it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options only the e2e level reads (the others are bench's: --workloads, --methods, --layouts, ...)."""
    parser.add_argument("--steps", type=int, default=5, help="e2e: denoising steps per generation (default 5)")
    parser.add_argument("--true-cfg-scale", type=float, default=None,
                        help="e2e, Flux and Qwen-Image workloads: true classifier-free guidance with an empty "
                             "negative prompt when > 1 (two branches per step, which ours-cfg splits over the "
                             "ranks); CogVideoX and Wan guide with their own guidance scale")


def _baseline_layouts(spec: str) -> set[tuple[str | None, int, int, int]] | None:
    """--layouts for the baselines as (system or None for both, cfg, ulysses, ring): 'best' / 'all' (None: every
    layout), or items like U2R1, cfg2U1R1, xfuser:U2R1 (a system prefix limits an item to that baseline)."""
    if spec in ("best", "all"):
        return None
    wanted = set()
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        match = re.fullmatch(rf"(?:({'|'.join(BASELINES)}):)?(?:cfg(\d))?U(\d+)R(\d+)", item)
        if not match:
            raise ValueError(f"layout {item!r} is not like U2R1, cfg2U1R1 or xfuser:U2R1 (the e2e baselines' "
                             f"layouts)")
        system, *degrees = match.groups()
        cfg, u, r = (int(x) if x else 1 for x in degrees)
        wanted.add((system, cfg, u, r))
    return wanted


def _wanted(wanted: set | None, system: str, cfg: int, u: int, r: int) -> bool:
    return wanted is None or bool({(system, cfg, u, r), (None, cfg, u, r)} & wanted)


def _xfuser_missing() -> str | None:
    """Why xfuser cannot run here, or None; tried on every rank before the job, so all ranks skip it alike."""
    if importlib.util.find_spec("xfuser") is None:
        return f"not installed ({install_hint('xdit')})"
    try:
        import xfuser  # noqa: F401
    except Exception as err:  # xfuser raises NotImplementedError without a GPU, ImportError for missing parts
        return f"it does not import ({type(err).__name__}: {err})"
    return None


def _degrees(world: int, heads: int, ring_ok: bool) -> list[tuple[int, int]]:
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and heads % u == 0
            and (ring_ok or u == world)]


def e2e_cases(systems: list[str], setup: Any, world: int, gpu: bool, layouts: str, notes: list[str]) -> list[Any]:
    """The cases of one workload; what cannot run is left out with its reason added to `notes` (once)."""
    from .e2e import E2ECase

    spec = MODELS[setup.model]
    heads, family = spec.transformer["num_attention_heads"], spec.family
    tokens = spec.image_tokens(setup.height, setup.width, setup.frames)
    text = family_of(setup.model).joint_text(spec, setup.max_sequence_length)  # what diffusers' plan splits
    is_guided = guided(spec, setup.guidance_scale, setup.true_cfg_scale)
    wanted = _baseline_layouts(layouts)
    cases: list[E2ECase] = []

    def skip(why: str) -> None:
        if why not in notes:
            notes.append(why)

    for system in systems:
        if system in BASELINES and setup.emulate_link:
            skip(f"{system} skipped: --emulate-link slows our transfers only, the baselines' would cross the real "
                 f"link; time them without it")
        elif system == "ours-cfg" and not is_guided:
            skip(f"ours-cfg skipped for {setup.name}: no guidance branches (CogVideoX and Wan with guidance > 1, "
                 f"Flux and Qwen-Image with --true-cfg-scale > 1; Flux.2 has none)")
        elif system == "ours-cfg" and world % 2:
            skip(f"ours-cfg skipped: {world} ranks do not split into two guidance branches")
        elif system == "diffusers-cp" and not gpu:
            skip(NO_GPU.format("diffusers-cp", "enable_parallelism places rank r on accelerator r"))
        elif (system == "diffusers-cp" or system in cachedit.SYSTEMS) and world == 1:
            skip(f"{system} skipped: its context parallelism needs 2+ ranks (diffusers refuses a Ulysses and Ring "
                 f"degree of 1); one-gpu is the one-rank row")
        elif system == "diffusers-cp" and not family_of(setup.model).diffusers_cp:
            skip(f"diffusers-cp skipped for {setup.name}: diffusers 0.42 has no context-parallel plan for CogVideoX")
        elif system == "diffusers-cp" and text is None and world > 1:
            skip(f"diffusers-cp skipped for {setup.name}: its text is as long as the prompt's tokens, which "
                 f"diffusers' equal split must divide by the {world} ranks (--level step times it on a fixed text)")
        elif system == "diffusers-cp" and (tokens % world or (text or 0) % world):
            skip(f"diffusers-cp skipped for {setup.name}: it needs the {tokens} image and "
                 f"{text} text tokens each divisible by the {world} ranks")
        elif system == "xfuser" and not gpu:
            skip(NO_GPU.format("xfuser", "xfuser 0.7.0 raises 'No Accelerators available' on import without one"))
        elif system == "xfuser" and family != "cogvideox":
            skip(f"xfuser skipped for {setup.name}: the e2e level compares xfuser on CogVideoX, diffusers-cp on the "
                 f"others")
        elif system == "xfuser" and (broken := _xfuser_missing()):
            skip(f"xfuser skipped: {broken}")
        elif system in cachedit.SYSTEMS and not gpu:
            skip(NO_GPU.format("cache-dit", "its context parallelism places rank r on accelerator r, as diffusers'"))
        elif system in cachedit.SYSTEMS and (broken := cachedit.missing()):
            skip(f"cache-dit skipped: {broken}")
        elif system in cachedit.SYSTEMS:
            for u, r in _degrees(world, heads, True):
                why = cachedit.why_not(system, u, r, family)
                if why is None and _wanted(wanted, system, 1, u, r):
                    cases.append(E2ECase(system, u, r))
                elif why is not None and wanted is None:
                    skip(f"{system} U{u}R{r} skipped: {why}")
        elif system == "diffusers-cp":
            half = setup.dtype in (torch.float16, torch.bfloat16)  # diffusers' ring needs cuDNN's LSE
            cases += [E2ECase(system, u, r) for u, r in _degrees(world, heads, half)
                      if _wanted(wanted, system, 1, u, r)]
        elif system == "xfuser":
            for cfg in ((2, 1) if is_guided and world % 2 == 0 else (1,)):
                cases += [E2ECase(system, u, r, cfg) for u, r in _degrees(world // cfg, heads, True)
                          if _wanted(wanted, system, cfg, u, r)]
        else:
            cases.append(E2ECase(system))
    return cases


def _setup(spec: str, args: argparse.Namespace, size: str, dtype: torch.dtype, m: int) -> Any:
    from .e2e import E2ESetup

    w = parse_workload(spec)
    if w.model is None:
        raise ValueError(f"--level e2e runs whole pipelines: use MODEL:WIDTH[:HEIGHT] (flux-dev, flux2-dev, "
                         f"qwen-image) or MODEL:FRAMES[:HEIGHT:WIDTH] (cogvideox-5b, wan2.2-ti2v-5b, "
                         f"wan2.2-t2v-a14b), not {spec!r}")
    model = w.model if size == "real" else TINY[w.model]
    frames, height, width = w.size
    model_spec = MODELS[model]
    true_cfg = args.true_cfg_scale if family_of(model).cfg_by == "true_cfg_scale" else None  # the others: ignored
    return E2ESetup(w.name, model, size == "real", height, width, frames, args.steps, model_spec.guidance_scale,
                    true_cfg, model_spec.max_sequence_length, DEFAULT_PROMPT, args.seed, dtype, args.machines, m,
                    args.backend, args.recipe, args.comm_dtype, args.emulate_link, args.iters, args.warmup,
                    args.timeout)


def run_tasks(tasks: list[tuple[Any, list[Any]]]) -> list[dict]:
    """On every rank: each workload's cases in turn, in one job."""
    from .e2e import bench_e2e

    return [row for setup, cases in tasks for row in bench_e2e(setup, cases)]


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """bench --level e2e: plan the cases, run the job, print and write the tables (rank 0)."""
    from ..core.exactness import LOWP_THRESHOLD, MODEL_THRESHOLD
    from .e2e import OURS

    world, gpu = job_shape(args.machines * (args.gpus_per_machine or 8), args.cpu)
    m = args.gpus_per_machine or world // args.machines
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    size = args.model_size or ("real" if gpu else "tiny")
    systems = [s.strip() for s in (args.methods or ",".join(SYSTEMS)).split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown system(s) {unknown} for --level e2e; choose from {', '.join(SYSTEMS)}")
    if args.steps < 1:
        raise ValueError("--steps must be at least 1")
    if args.emulate_link:
        parse_link(args.emulate_link)
    notes: list[str] = []
    tasks = []
    for spec in workload_specs(args.workloads):
        setup = _setup(spec, args, size, dtype, m)
        tasks.append((setup, e2e_cases(systems, setup, world, gpu, args.layouts, notes)))
    rank0 = int(os.environ.get("RANK", 0)) == 0
    for note in notes if rank0 else ():
        print(f"streamfusion bench: {note}", file=sys.stderr)
    generations = sum((len(cases) + 2) * (args.warmup + args.iters + 1) for _, cases in tasks)
    rows = run_job(run_tasks, world, tasks, gpu=gpu, timeout_s=max(DEFAULT_TIMEOUT_S, args.timeout * generations))[0]
    if not rank0:
        return 0
    def tolerance(row: dict) -> float:  # our rows over 1-byte transfers round; the baselines never use them
        return LOWP_THRESHOLD if args.comm_dtype and row["system"] in OURS else MODEL_THRESHOLD[dtype]

    for row in rows:
        row["ok"] = row["rel_err"] is None or row["rel_err"] <= tolerance(row)
    link = f", inter-machine link emulated as {args.emulate_link}" if args.emulate_link else ""
    comm = f", {args.comm_dtype} inter-machine transfers" if args.comm_dtype else ""
    title = (f"Whole generations ({size} models, random weights), {args.machines} x {m} "
             f"{'GPUs' if gpu else 'CPU processes'}{link}{comm}, {str(dtype).removeprefix('torch.')}, "
             f"{args.steps} steps, "
             f"seconds: median (min - max) of {args.iters} after {args.warmup} warm-up, slowest rank")
    lines = e2e_report.summary(rows, OURS)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"outputs/bench-e2e-{stamp}")
    setup_info = {"command": "streamfusion bench " + " ".join(argv), "world": world, "gpu": gpu,
                  "device": torch.cuda.get_device_name() if gpu else "cpu", "date": stamp, "levels": ["e2e"],
                  "model_size": size, "steps": args.steps}
    paths = e2e_report.write(rows, setup_info, notes, lines, out, title)
    if args.json:
        print(paths[0].read_text())
    else:
        print(e2e_report.markdown(rows, title))
        print("\n".join(lines))
        print("wrote " + ", ".join(str(p) for p in paths))
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        what = "MISMATCH" if r["system"] in OURS else "note: baseline differs"
        print(f"{what}: {r['workload']} {r['case']} output vs {r['reference']}: relative error {r['rel_err']:.2e} > "
              f"{tolerance(r):g}")
    return 1 if any(r["system"] in OURS for r in bad) else 0

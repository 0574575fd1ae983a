"""`streamfusion tune`: measure the fastest layout for each workload on this cluster and write it into recipes.

For each workload the cost model ranks every distinct layout of every method on N x M (the emulated link or
the real one); the K best predicted, plus plain Ulysses and USP, are timed at the layer level in one job with
repetitions interleaved across them (optionally the best two again at block level). Every candidate's
output is checked against exact attention (exactness.py, layer and block); a layout that fails is reported,
left out of the measurements and never written. The fastest that passes becomes a recipe entry
(`source: measured`) merged into <out>/<model>.yaml; every case's measured and predicted time goes
to <out>/measurements.json, from which the cost model's overheads are fitted into the recipe headers.
`--from-cost-model` writes predicted entries (`source: cost model`) for shapes nobody measured, and
`--merge-from` merges device runs' outputs into a recipe folder (the packaged one: choice/regenerate.py);
neither runs a job.
"""
from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..runtime.run import job_shape, run_job
from ..commands.timing import ITERS, SAMPLE_MS, WARMUP
from ..commands.verify import DTYPES
from ..choice.calibrate import fit
from ..choice.choose import Cluster, gpu_of, ranked, schedule_key
from ..choice.predictions import load_records, table
from ..choice.recipe import FOLDER_VARIABLE, gpu_kind, load_recipe, user_folder
from ..choice.regenerate import from_cost_model, merge_from, parse_shapes
from ..choice.store import layout_fields, link_name, write_recipe, write_records
from ..choice.workloads import Workload, parse_workload, transformer_config, workload_specs
from ..core.config import ParallelConfig, layout_label, machine_shape, resolve_layout
from ..core.exactness import passes
from . import report
from .command import limit
from .layer import Case, Setup, bench_layer, padded_length
from .records import records_from_bench

DEFAULT_TOP = 6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="flux-dev:1024,flux-dev:2048",
                        help="comma-separated, as bench takes them: flux-dev:WIDTH[:HEIGHT], "
                             "cogvideox-5b:FRAMES[:HEIGHT:WIDTH], custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM")
    parser.add_argument("--machines", type=int, default=1, help="machines N (virtual ones with --emulate-link)")
    parser.add_argument("--gpus-per-machine", type=int, default=None, help="default: world size / N (8 locally)")
    parser.add_argument("--shapes", default=None,
                        help="--from-cost-model only: several cluster shapes NxM[:LINK], e.g. 1x2,2x8,2x1:p4de "
                             "(default N x M; LINK defaults to --emulate-link, else real)")
    parser.add_argument("--emulate-link", default=None, help="slow the inter-machine link: dgx, p4de, p5 or GBPS:US")
    parser.add_argument("--backend", default="torch", help="transport of our methods: torch or nvshmem")
    parser.add_argument("--kernel", default="auto", help="attention kernel: auto, reference, sdpa or fused")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bfloat16 on GPU, else float32")
    parser.add_argument("--top", type=int, default=DEFAULT_TOP,
                        help=f"layouts timed per workload: the K best predicted, plus plain ulysses and usp "
                             f"(default {DEFAULT_TOP})")
    parser.add_argument("--confirm-blocks", action="store_true",
                        help="time the best two again at block level (real-size models, GPUs only) and keep the "
                             "block level's winner")
    parser.add_argument("--iters", type=int, default=ITERS,
                        help=f"timed samples per case, each at least {SAMPLE_MS:g} ms of back-to-back calls "
                             f"(default {ITERS}, as bench)")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help=f"untimed rounds of every case first (default {WARMUP}, as bench)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take (default 300)")
    parser.add_argument("--out", default=str(user_folder()),
                        help="folder of the recipes to write or merge into (<model>.yaml) and measurements.json; "
                             "streamfusion_diffusers/choice/recipes regenerates the packaged ones (default: your recipe "
                             f"folder, which method auto reads first: ${FOLDER_VARIABLE} or "
                             "~/.cache/streamfusion/recipes)")
    parser.add_argument("--from-cost-model", action="store_true",
                        help="write the cost model's choice (source: cost model) where no entry was measured; "
                             "runs no job")
    parser.add_argument("--merge-from", nargs="+", default=None, metavar="FOLDER",
                        help="merge the measured entries and measurements.json of tune runs' --out folders (e.g. "
                             "fetched from a device; bench --out folders add their layer timings) into the recipes "
                             "under --out, refit the calibration and predict the remaining cost-model entries "
                             "again; runs no job")
    parser.add_argument("--report", nargs="+", default=None, metavar="FILE",
                        help="print the cost model's predictions against the measurements in tune's "
                             "measurements.json or bench's results.json files, before and after fitting it "
                             "(a markdown table for BENCHMARKS.md); runs no job")
    parser.add_argument("--cpu", action="store_true", help="spawn gloo processes on the CPU even if GPUs exist")


def _model(spec: str) -> str:
    return spec.split(":")[0]


def _size(spec: str, w: Workload) -> dict:
    """The size fields of an entry: resolution / frames as users give them, and the attention shape."""
    name, *values = spec.split(":")
    size = {}
    if name == "flux-dev" and values:
        size = {"resolution": int(values[0])} | ({"height": int(values[1])} if len(values) > 1 else {})
    elif name == "cogvideox-5b" and values:
        size = {"frames": int(values[0])} | (dict(zip(("height", "width"), map(int, values[1:]))))
    return {**size, "tokens": w.tokens, "text_tokens": w.text_tokens, "heads": w.heads, "head_dim": w.head_dim}


def layer_workload(w: Workload, world: int) -> Workload:
    """What the layer level times: the text rides in the sequence, padded to a multiple of P."""
    return Workload(w.name, padded_length(w, world), 0, w.heads, w.head_dim, w.blocks, w.batch)


def _case(lay) -> Case:
    return Case(lay.method, lay.ulysses, lay.ring, lay.torus if lay.method == "torus" else None)


def shortlist(w: Workload, cluster: Cluster, world: int, top: int, calibration: dict | None,
              elem_bytes: int) -> dict[Case, float]:
    """Case -> predicted layer ms, for the cases to time: the `top` best predicted, plus plain ulysses and usp
    (the layouts users get by naming the method) where the heads allow them."""
    preds = ranked(layer_workload(w, world), cluster, gpu_of(calibration), elem_bytes)
    plain = set()
    for method in ("ulysses", "usp"):
        config = ParallelConfig(machines=cluster.machines, gpus_per_machine=cluster.gpus_per_machine, method=method)
        try:
            plain.add(schedule_key(resolve_layout(config, world, w.heads)))
        except ValueError:  # e.g. plain Ulysses with fewer heads than ranks
            continue
    keep = preds[:top] + [p for p in preds[top:] if schedule_key(p.layout) in plain]
    return {_case(p.layout): p.layer_ms for p in keep}


def _rank_job(tasks: list[tuple[Setup, list[Case], dict | None]]) -> list[dict]:
    """On every rank: each workload's cases at layer level, interleaved; then the best two at block level."""
    rows = []
    for setup, cases, model_config in tqdm(tasks, desc="tune", disable=dist.get_rank() != 0):
        layer = bench_layer(setup, [Case("bound"), *cases])
        rows += layer
        if model_config is not None:
            from ..bench.model import ModelSetup, bench_model  # imports diffusers

            exact = (r for r in layer if r["method"] != "bound" and passes(r["rel_err"], setup.dtype))
            ours = sorted(exact, key=lambda r: r["ms"])[:2]
            best = [c for r in ours for c in cases if c.label == r["layout"]]
            rows += bench_model(ModelSetup(setup, model_config, ("block",)), [Case("bound"), *best])
    return rows


def _records(rows: list[dict], predicted: dict[str, float], w: Workload, world: int, info: dict) -> list[dict]:
    lw = layer_workload(w, world)
    out = []
    for r in rows:
        if r["level"] != "layer" or not r["ok"]:  # a layout that is not exact calibrates nothing
            continue
        case = next((c for c in predicted if c.label == r["layout"]), Case("bound"))
        out.append({**info, "kind": "bound" if case.method == "bound" else "layer", "workload": w.name,
                    "tokens": lw.tokens, "heads": w.heads, "head_dim": w.head_dim, "batch": w.batch,
                    "method": case.method, "ulysses": case.ulysses, "ring": case.ring, "torus": case.torus,
                    "min_ms": r["min_ms"], "ms": r["ms"], "max_ms": r["max_ms"], "calls": r["calls"],
                    "predicted_ms": predicted.get(case)})
    return out


def _entry(spec: str, w: Workload, rows: list[dict], cases: list[Case], info: dict) -> dict:
    layer = sorted((r for r in rows if r["level"] == "layer" and r["method"] != "bound" and r["ok"]),
                   key=lambda r: r["ms"])
    if not layer:
        raise RuntimeError(f"tune: no layout of {w.name} passed the exactness check (every one is reported above); "
                           f"run `streamfusion verify --self-test` on this cluster to see which method is wrong")
    by_label = {r["layout"]: r for r in layer}
    blocks = sorted((r for r in rows if r["level"] == "block" and r["method"] != "bound" and r["ok"]
                     and r["layout"] in by_label), key=lambda r: r["ms"])
    order = [r["layout"] for r in blocks] + [r["layout"] for r in layer if r["layout"] not in
                                             {b["layout"] for b in blocks}]
    best, runner = by_label[order[0]], by_label[order[1]] if len(order) > 1 else None
    case = next(c for c in cases if c.label == best["layout"])
    entry = {"model": _model(spec), **_size(spec, w), "machines": info["machines"],
             "gpus_per_machine": info["gpus_per_machine"], "link": info["link"], **layout_fields(case),
             "backend": info["backend"], "kernel": info["kernel"], "dtype": info["dtype"],
             "ms": {"min": round(best["min_ms"], 4), "median": round(best["ms"], 4), "max": round(best["max_ms"], 4)}}
    if case.method != "torus":
        entry.pop("torus", None)
    if runner is not None:
        entry["runner_up"] = {"layout": runner["layout"], "median": round(runner["ms"], 4)}
        entry["margin"] = round(runner["ms"] / best["ms"] - 1, 4)
    if blocks:
        entry["block_ms"] = {r["layout"]: round(r["ms"], 4) for r in blocks}
    return {**entry, "source": "measured", "device": info["device"], "date": info["date"]}


def _from_cost_model(args: argparse.Namespace, specs: list[str]) -> int:
    default = [f"{args.machines}x{args.gpus_per_machine or 8}"]
    shapes = parse_shapes(args.shapes or ",".join(default), link_name(args.emulate_link))
    workloads = [(_model(spec), w, {"model": _model(spec), **_size(spec, w)})
                 for spec, w in ((spec, parse_workload(spec)) for spec in specs)]
    return from_cost_model(workloads, shapes, Path(args.out), args.backend, args.kernel,
                           DTYPES[args.dtype or "bfloat16"].itemsize)


def main(args: argparse.Namespace) -> int:
    specs = workload_specs(args.workloads)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.report:
        print(table(load_records(args.report, records_from_bench)))
        return 0
    if args.merge_from:
        return merge_from(args.merge_from, Path(args.out), records_from_bench)
    if args.from_cost_model:
        return _from_cost_model(args, specs)
    world, gpu = job_shape(args.machines * (args.gpus_per_machine or 8), args.cpu)
    m = args.gpus_per_machine or world // args.machines
    machine_shape(ParallelConfig(machines=args.machines, gpus_per_machine=m), world)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    cluster = Cluster(args.machines, m, link_name(args.emulate_link), args.backend)
    out = Path(args.out)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    tasks, plans = [], []
    for spec in specs:
        w = parse_workload(spec)
        path = out / f"{_model(spec)}.yaml"
        calibration = load_recipe(str(path)).calibration_for(device) if path.is_file() else None
        predicted = shortlist(w, cluster, world, args.top, calibration, dtype.itemsize)
        setup = Setup(w, args.machines, m, args.backend, args.emulate_link, dtype, args.iters, args.warmup,
                      args.seed, args.timeout, kernel=args.kernel)
        confirm = args.confirm_blocks and gpu and w.model is not None
        tasks.append((setup, list(predicted), transformer_config(w, "real") if confirm else None))
        plans.append((spec, w, predicted))
    rows = run_job(_rank_job, world, tasks, gpu=gpu, timeout_s=args.timeout * (2 + sum(len(t[1]) for t in tasks)))[0]
    if int(os.environ.get("RANK", 0)) != 0:
        return 0
    info = {"device": device, "date": datetime.date.today().isoformat(),
            "machines": args.machines, "gpus_per_machine": m, "link": cluster.link, "backend": args.backend,
            "kernel": args.kernel, "dtype": str(dtype).removeprefix("torch."), "elem_bytes": dtype.itemsize}
    for r in rows:
        r["ok"] = r["rel_err"] is None or r["rel_err"] <= limit(r, dtype)
        if not r["ok"]:
            print(f"tune: {r['workload']} {r['level']} {r['layout']} is not exact (relative error "
                  f"{r['rel_err']:.2e} > {limit(r, dtype):.1e}): left out of the recipe and the measurements")
    print(report.markdown([r for r in rows if r["level"] == "layer"],
                          f"## streamfusion tune: one attention layer, {args.machines} x {m} ({cluster.link}), "
                          f"{info['dtype']}, min / median / max per call of {args.iters} samples of >= {SAMPLE_MS:g} "
                          f"ms after {args.warmup} warm-up, interleaved across cases"))
    records, by_model = [], {}
    for spec, w, predicted in plans:
        mine = [r for r in rows if r["workload"] == w.name]
        records += _records(mine, predicted, w, world, info)
        by_model.setdefault(_model(spec), []).append(_entry(spec, w, mine, list(predicted), info))
    every = write_records(out / "measurements.json", records)
    calibration = {gpu_kind(device): fit([r for r in every if gpu_kind(r["device"]) == gpu_kind(device)])}
    for model, entries in by_model.items():
        path = write_recipe(out / f"{model}.yaml", model, entries, calibration)
        for e in entries:
            chosen = layout_label(e["method"], e["ulysses"], e["ring"], e.get("torus"))
            print(f"{e['model']} {e.get('resolution') or e.get('frames') or e['tokens']} on {e['machines']} x "
                  f"{e['gpus_per_machine']} ({e['link']}): {chosen} {e['ms']['median']:.3f} ms "
                  f"[{e['ms']['min']:.3f} - {e['ms']['max']:.3f}]" +
                  (f", runner-up {e['runner_up']['layout']} +{100 * e['margin']:.1f}%" if "margin" in e else ""))
        print(f"wrote {path}")
    print(f"wrote {out / 'measurements.json'} ({len(records)} cases measured vs predicted)")
    return 0

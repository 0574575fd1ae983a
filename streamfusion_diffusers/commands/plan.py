"""`streamfusion plan`: predict every method and layout on a cluster shape, and recommend one.

For clusters nobody here can rent: the cost model (choice/costmodel.py) walks our schedules for N x M GPUs
and a real-size workload, with an inter-machine link preset or any bandwidth/latency pair, using the figures
fitted from measurements in the recipe's `calibration` header (the model's packaged recipe unless --recipe).
"""
from __future__ import annotations

import argparse
import json

from ..choice.choose import gpu_of
from ..choice.costmodel import candidate_layouts, predict
from ..choice.recipe import load_recipe
from ..choice.workloads import COGVIDEOX_PLAN_HEIGHT, COGVIDEOX_PLAN_WIDTH, cogvideox, flux
from ..core.config import METHODS
from ..core.links import PRESETS, parse_link


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--machines", type=int, required=True, help="machines N")
    parser.add_argument("--gpus-per-machine", type=int, default=8, help="GPUs per machine M (default 8)")
    parser.add_argument("--model", choices=("flux-dev", "cogvideox-5b"), default="flux-dev")
    parser.add_argument("--resolution", type=int, default=None,
                        help=f"Flux: square side in pixels (default 1024); CogVideoX: height "
                             f"(default {COGVIDEOX_PLAN_HEIGHT})")
    parser.add_argument("--width", type=int, default=None, help=f"CogVideoX width (default {COGVIDEOX_PLAN_WIDTH})")
    parser.add_argument("--frames", type=int, default=49, help="CogVideoX frames (4k + 1)")
    parser.add_argument("--link", default="dgx", help=f"inter-machine link: {', '.join(PRESETS)} or GBPS:LATENCY_US")
    parser.add_argument("--recipe", default=None,
                        help="recipe whose calibration header the cost model uses (default: the model's packaged one)")
    parser.add_argument("--all", action="store_true", help="list every layout, not only each method's best")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def main(args: argparse.Namespace) -> int:
    if args.model == "flux-dev":
        workload = flux(args.resolution or 1024)
    else:
        workload = cogvideox(args.frames, args.resolution or COGVIDEOX_PLAN_HEIGHT, args.width or COGVIDEOX_PLAN_WIDTH)
    link = parse_link(args.link)
    gpu = gpu_of(load_recipe(args.recipe or args.model).calibration)
    predictions = {m: [predict(lay, workload, link, gpu) for lay in
                       candidate_layouts(m, args.machines, args.gpus_per_machine, workload.heads)] for m in METHODS}
    best = {m: min(ps, key=lambda p: p.step_ms) for m, ps in predictions.items() if ps}
    recommended = min(best.values(), key=lambda p: p.step_ms)
    if args.json:
        print(json.dumps({
            "workload": workload.name, "machines": args.machines, "gpus_per_machine": args.gpus_per_machine,
            "link": {"name": link.name, "gb_per_s": link.gb_per_s, "latency_us": link.latency_us},
            "recommended": {"method": recommended.layout.method, **recommended.as_dict()},
            "methods": {m: p.as_dict() for m, p in best.items()},
        }, indent=2))
        return 0
    print(f"{workload.name}: {workload.tokens} tokens + {workload.text_tokens} text, {workload.heads} heads x "
          f"{workload.head_dim}, on {args.machines} x {args.gpus_per_machine} GPUs; inter-machine link {link.name} "
          f"({link.gb_per_s:g} GB/s per GPU, {link.latency_us:g} us)")
    print(f"{'method':<8} {'layout':<10} {'inter MB/GPU':>12} {'layer ms':>9} {'step ms':>9}")
    for method in METHODS:
        rows = sorted(predictions[method], key=lambda p: p.step_ms)
        rows = rows if args.all else rows[:1]
        if not rows:
            print(f"{method:<8} {'-':<10} needs the {workload.heads} heads divisible by "
                  f"{args.machines * args.gpus_per_machine} ranks")
        for p in rows:
            print(f"{method:<8} {p.layout.degrees:<10} {p.inter_machine_bytes_per_gpu / 1e6:>12.1f} {p.layer_ms:>9.2f} "
                  f"{p.step_ms:>9.1f}")
    usp = best.get("usp")
    speedup = f", {usp.step_ms / recommended.step_ms:.2f}x USP's best" if usp else ""
    print(f"recommended: {recommended.layout.label} "
          f"(predicted {recommended.step_ms:.0f} ms per step{speedup})")
    return 0

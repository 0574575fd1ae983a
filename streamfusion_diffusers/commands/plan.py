"""`streamfusion plan`: predict every method and layout on a cluster shape, and recommend one; with --memory, what
one GPU holds at its peak, with and without sharded weights, and which GPUs that fits.

For clusters nobody here can rent: the cost model (choice/costmodel.py) walks our schedules for N x M GPUs
and a workload of any model `generate` runs (models/configs.py MODELS), with an inter-machine link preset or any
bandwidth/latency pair, using the figures fitted from measurements in the recipe's `calibration` header (the
model's packaged recipe where it has one, else Flux.1-dev's, unless --recipe) for the GPU kind of --gpu: plan
predicts clusters it does not run on, so the GPU is named, not read from this machine. Beside each layout's predicted
time, its link bound: the busiest rank's bytes and messages across machines in one layer, on the link alone.
The memory estimate is models/memory.py's, from the real configs on the meta device. With --serve, every replica split of the machines
for `streamfusion serve --replicas R` (choice/replicas.py): latency per request and images per minute.
"""
from __future__ import annotations

import argparse
import json

from ..choice.choose import gpu_of
from ..choice.costmodel import Gpu, candidate_layouts, predict
from ..choice.recipe import PACKAGED, gpu_kind, load_recipe
from ..choice.replicas import Split, plan_replicas, recommend, record_path, records_of
from ..choice.workloads import COGVIDEOX_PLAN_HEIGHT, COGVIDEOX_PLAN_WIDTH, Workload, cogvideox, flux
from ..choice.workloads import MODELS as WORKLOADS
from ..core.config import METHODS
from ..core.links import PRESETS, parse_link
from ..models import MODELS
from ..runtime.execution import graph_choice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--machines", type=int, default=1, help="machines N (default 1)")
    parser.add_argument("--gpus-per-machine", type=int, default=8, help="GPUs per machine M (default 8)")
    parser.add_argument("--model", choices=sorted(MODELS), default="flux-dev", help="any model generate runs")
    parser.add_argument("--resolution", type=int, default=None,
                        help=f"height in pixels (default: the model's; flux-dev 1024, cogvideox-5b "
                             f"{COGVIDEOX_PLAN_HEIGHT}); an image model's width too unless --width")
    parser.add_argument("--width", type=int, default=None,
                        help=f"width in pixels (default: the model's; cogvideox-5b {COGVIDEOX_PLAN_WIDTH})")
    parser.add_argument("--frames", type=int, default=None, help="video models: frames (default: the model's)")
    parser.add_argument("--memory", action="store_true",
                        help="per-GPU memory at its peak, whole weights and sharded (--shard-weights), and which "
                             "GPUs (24/40/48/80/141 GB) it fits, instead of the layouts")
    parser.add_argument("--serve", action="store_true",
                        help="every replica split R x P/R for `streamfusion serve --replicas R` on --machines x --gpus-per-machine: "
                             "latency per request and images (videos) per minute, predicted from the cost model "
                             "and recorded generations, and which split gives the lowest latency / the most")
    parser.add_argument("--steps", type=int, default=None, help="--serve: denoising steps per request "
                                                                "(default: the model's)")
    parser.add_argument("--gpu-memory", type=float, default=80.0,
                        help="--serve: GB of memory per GPU, as sold (default 80: an H100)")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                        help="--serve: steps replayed from CUDA graphs, serve's default on GPUs (--no-cuda-graph: "
                             "eager, each step as long as the host's issue of it where that is longer)")
    parser.add_argument("--cache", default=None, metavar="NAME[:VALUE]",
                        help="--serve: the cache serve runs with (its steps run eager)")
    parser.add_argument("--shard-weights", action="store_true",
                        help="--serve: the group runs with sharded weights (gathered in place, inside the graphs)")
    parser.add_argument("--streamed-blocks", choices=("gather", "tensor", "auto"), default="auto",
                        help="--memory: how the sharded run's streamed blocks run (generate's flag of that name; "
                             "auto: the way that moves fewer bytes a step, which the row names)")
    parser.add_argument("--cfg", type=int, choices=(1, 2), default=1, help="--memory: the CFG split's degree")
    parser.add_argument("--max-memory", type=float, default=None, metavar="GIB",
                        help="--memory: GiB per GPU the sharded run may take; its row shows which blocks stay "
                             "gathered to fit (default: every block sharded)")
    parser.add_argument("--link", default="dgx", help=f"inter-machine link: {', '.join(PRESETS)} or GBPS:LATENCY_US")
    parser.add_argument("--recipe", default=None,
                        help="recipe whose calibration header the cost model uses (default: the model's packaged one)")
    parser.add_argument("--gpu", default=None,
                        help="GPU kind whose calibration the cost model uses, one of the recipe header's (the "
                             "packaged ones: H200, H100; default: the header's first, the GPUs its entries were "
                             "measured on)")
    parser.add_argument("--all", action="store_true", help="list every layout, not only each method's best")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def size_of(args: argparse.Namespace) -> tuple[int, int, int]:
    """(frames, height, width) asked for: the model's own where not given (CogVideoX-5b: the plan's 768 x 1360)."""
    spec = MODELS[args.model]
    if args.model == "cogvideox-5b":
        height, width = args.resolution or COGVIDEOX_PLAN_HEIGHT, args.width or COGVIDEOX_PLAN_WIDTH
    elif spec.video:
        height, width = args.resolution or spec.height, args.width or spec.width
    else:
        height = args.resolution or spec.height
        width = args.width or args.resolution or spec.width
    if args.frames is not None and not spec.video:
        raise ValueError(f"--frames is for video models; {args.model} makes images")
    return (args.frames or spec.frames) if spec.video else 1, height, width


def workload_of(args: argparse.Namespace) -> Workload:
    """The cost model's workload: the real-size model's (choice/workloads.py), or a tiny model's attention shape."""
    frames, height, width = size_of(args)
    if args.model == "flux-dev":
        return flux(width, height)
    if args.model == "cogvideox-5b":
        return cogvideox(frames, height, width)
    if args.model in WORKLOADS:
        return WORKLOADS[args.model](*((frames, height, width) if MODELS[args.model].video else (width, height)))
    spec = MODELS[args.model]
    return Workload(f"{args.model} {width}x{height}", spec.image_tokens(height, width, frames), 0, *spec.attention)


def calibrated(args: argparse.Namespace) -> tuple[str, Gpu]:
    """The GPU kind planned for and the cost model's figures for it, from the recipe's calibration header."""
    packaged = (PACKAGED / f"{args.model}.yaml").is_file()
    recipe = load_recipe(args.recipe or (args.model if packaged else "flux-dev"))
    kinds = list(recipe.calibration or {})
    if args.gpu and gpu_kind(args.gpu) not in kinds:
        raise ValueError(f"--gpu {args.gpu}: recipe {recipe.path} is calibrated for "
                         f"{', '.join(kinds) or 'no GPU kind'}; pass one of those (or --recipe another)")
    kind = gpu_kind(args.gpu) if args.gpu else (kinds[0] if kinds else "uncalibrated GPU")
    return kind, gpu_of(recipe.calibration_for(args.gpu))


def memory(args: argparse.Namespace) -> int:
    """--memory: models/memory.py's estimate, whole weights and sharded, as a table or JSON."""
    from ..models.memory import GIB, GPUS_GB, RUNTIME_GIB, estimate, pipeline_parts, streamed_choice

    frames, height, width = size_of(args)
    ranks = args.machines * args.gpus_per_machine
    if args.cfg > ranks:
        raise ValueError(f"--cfg {args.cfg} needs at least {args.cfg} GPUs")
    parts = pipeline_parts(args.model)
    streamed = args.streamed_blocks if args.streamed_blocks != "auto" else streamed_choice(
        args.model, height, width, frames, ranks, cfg=args.cfg, parts=parts, max_memory=args.max_memory)
    rows = [estimate(args.model, height, width, frames, ranks, cfg=args.cfg, sharded=s, parts=parts,
                     max_memory=args.max_memory, streamed=streamed) for s in (False, True)]
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(f"{args.model} {rows[0].size} on {args.machines} x {args.gpus_per_machine} GPUs (cfg {args.cfg}), bf16, "
          f"GiB per GPU at its peak")
    print(f"{'weights':<8} {'held':>6} {'gathered':>8} {'activ.':>7} {'attn':>6} {'vae dec':>7} {'encode':>7} "
          f"{'peak':>6}  fits (GB, {RUNTIME_GIB:g} GiB runtime beside)")
    for r in rows:
        fits = ", ".join(map(str, r.fits)) or f"none of {', '.join(map(str, GPUS_GB))}"
        print(f"{'sharded' if r.sharded else 'whole':<8} {r.weights:>6.1f} {r.gathered:>8.1f} {r.activations:>7.2f} "
              f"{r.attention:>6.2f} {r.vae_decode:>7.2f} {r.text_encoder:>7.1f} {r.peak:>6.1f}  {fits}")
        if r.split:
            moved = f", {r.tokens:.2f} GiB of token rows (tensor-parallel blocks)" if r.tokens else ""
            print(f"         split: {r.split}; {r.received:.2f} GiB of weights received per rank per step{moved}")
        if r.sharded and r.streams:
            each = sum(p.total for p in parts.values()) / GIB
            print(f"         start-up with random weights: each rank makes the whole pipeline ({each:.1f} GiB) in "
                  f"host memory before sharding it, {args.gpus_per_machine * each:.0f} GiB per machine")
    return 0


def serve(args: argparse.Namespace) -> int:
    """--serve: every replica split of the machine's GPUs (choice/replicas.py), as a table or JSON."""
    from ..models.memory import GIB, RUNTIME_GIB, estimate, pipeline_parts

    one, two = records_of(args.model)
    steps = args.steps or MODELS[args.model].steps
    frames, height, width = size_of(args)
    workload_of(args)  # the size's checks (multiples of the patch, frames = 4k + 1), one line each
    parts = pipeline_parts(args.model)
    peaks = lambda ranks: tuple(estimate(args.model, height, width, frames, ranks, sharded=s,  # noqa: E731
                                         parts=parts).peak for s in (False, True))
    kind, gpu = calibrated(args)
    room = args.gpu_memory * 1e9 / GIB - RUNTIME_GIB
    graph, why = graph_choice(args, gpu=True)
    splits = plan_replicas(args.model, frames, height, width, args.gpus_per_machine, steps, gpu, peaks, room, graph,
                           args.machines)
    fastest, most = recommend(splits)
    unit = "videos" if MODELS[args.model].video else "images"
    size = f"{frames} x {height} x {width}" if MODELS[args.model].video else f"{height} x {width}"
    based = sorted({record_path(r) for r in (one, two) if r is not None})
    if args.json:
        print(json.dumps({
            "model": args.model, "size": size, "steps": steps, "machines": args.machines,
            "gpus": args.gpus_per_machine, "gpu_memory_gb": args.gpu_memory, "cuda_graph": {"on": graph, "why": why},
            "unit": unit, "records": based, "note": one.note,
            "splits": [s.as_dict() for s in splits],
            "lowest_latency": fastest.as_dict(), "most_per_minute": most.as_dict(),
        }, indent=2))
        return 0
    print(f"{args.model} {size}, {steps} steps, on {args.machines} x {args.gpus_per_machine} GPUs of {args.gpu_memory:g} GB: "
          f"`streamfusion serve --replicas R`, each group one request at a time")
    print(f"{'R x P/R':<8} {'layout':<14} {'step s':>7} {'text s':>7} {'decode s':>8} {'latency s':>9} "
          f"{unit + '/min':>11} {'GiB whole':>9} {'sharded':>7}  weights")
    for s in splits:
        print(f"{f'{s.replicas} x {s.ranks}':<8} {s.layout:<14} {s.step_s:>7.3f} {s.text_s:>7.3f} {s.decode_s:>8.3f} "
              f"{s.latency_s:>9.2f} {s.per_minute:>11.2f} {s.peak_whole_gib:>9.1f} {s.peak_sharded_gib:>7.1f}  "
              + (s.weights if s.excluded is None else f"excluded: {s.excluded}"))
    print(f"lowest latency: {_label(fastest)} ({fastest.latency_s:.2f} s per request); most {unit} per minute: "
          f"{_label(most)} ({most.per_minute:.2f})")
    path = "replayed from CUDA graphs" if graph else f"eager ({why}): the longer of the GPU's work and the host's"
    print(f"predicted for one {kind} per GPU, steps {path}: the GPU's work = the cost model's attention (calibrated) + "
          f"the rest of a recorded step scaled by tokens per rank; text and decode recorded ({', '.join(based)})")
    if one.note:
        print(f"note: {one.note}")
    return 0


def _label(split: Split) -> str:
    sharded = " with --shard-weights" if split.weights == "sharded" else ""
    spans = f", each across {split.machines} machines" if split.machines > 1 else ""
    return f"--replicas {split.replicas} ({split.replicas} x {split.ranks}{spans}{sharded})"


def main(args: argparse.Namespace) -> int:
    if args.serve:
        return serve(args)
    if args.memory:
        return memory(args)
    workload = workload_of(args)
    link = parse_link(args.link)
    kind, gpu = calibrated(args)
    predictions = {m: [predict(lay, workload, link, gpu) for lay in
                       candidate_layouts(m, args.machines, args.gpus_per_machine, workload.heads)] for m in METHODS}
    best = {m: min(ps, key=lambda p: p.step_ms) for m, ps in predictions.items() if ps}
    recommended = min(best.values(), key=lambda p: p.step_ms)
    if args.json:
        print(json.dumps({
            "workload": workload.name, "machines": args.machines, "gpus_per_machine": args.gpus_per_machine, "gpu": kind,
            "link": {"name": link.name, "gb_per_s": link.gb_per_s, "latency_us": link.latency_us},
            "recommended": {"method": recommended.layout.method, **recommended.as_dict()},
            "methods": {m: p.as_dict() for m, p in best.items()},
        }, indent=2))
        return 0
    print(f"{workload.name}: {workload.tokens} tokens + {workload.text_tokens} text, {workload.heads} heads x "
          f"{workload.head_dim}, on {args.machines} x {args.gpus_per_machine} GPUs; inter-machine link {link.name} "
          f"({link.gb_per_s:g} GB/s per GPU, {link.latency_us:g} us)")
    print(f"{'method':<8} {'layout':<10} {'inter MB/GPU':>12} {'messages':>8} {'link ms':>8} {'layer ms':>9} "
          f"{'step ms':>9}")
    for method in METHODS:
        rows = sorted(predictions[method], key=lambda p: p.step_ms)
        rows = rows if args.all else rows[:1]
        if not rows:
            print(f"{method:<8} {'-':<10} needs the {workload.heads} heads divisible by "
                  f"{args.machines * args.gpus_per_machine} ranks")
        for p in rows:
            print(f"{method:<8} {p.layout.degrees:<10} {p.link.bytes_per_gpu / 1e6:>12.1f} {p.link.messages:>8} "
                  f"{p.link.seconds * 1e3:>8.2f} {p.layer_ms:>9.2f} {p.step_ms:>9.1f}")
    usp = best.get("usp")
    speedup = f", {usp.step_ms / recommended.step_ms:.2f}x USP's best" if usp else ""
    print(f"recommended: {recommended.layout.label} "
          f"(predicted {recommended.step_ms:.0f} ms per step{speedup})")
    print("per attention layer: inter MB/GPU and messages the busiest rank sends across machines; link ms the "
          "least time the link takes for them (bandwidth, and latency per message), whatever overlaps them")
    return 0

"""xfuser's own Flux and CogVideoX pipelines with its USP attention, then with ours (issue 12), on P GPUs.

    torchrun --nproc-per-node 2 benchmarks/xdit_pipeline.py --ulysses-degree 2 --ring-degree 1 --out "$OUT"
    torchrun --nproc-per-node 2 benchmarks/xdit_pipeline.py --emulate-link p4de --skip-checks --out "$OUT"

xfuser makes its process groups once per process, so one run is one xfuser layout (--ulysses-degree x
--ring-degree, optionally --use-cfg-parallel); our variants are all timed inside it (our layouts do not depend
on xfuser's degrees: xfuser's SP rank i always holds the i-th slice). Every model is a diffusers pipeline built
offline with random weights (models/build.py), wrapped by xFuserFluxPipeline / xFuserCogVideoXPipeline as
xfuser's from_pretrained would, and called as xfuser's examples call it (one denoising step, latent output, the
same seed for every variant).
1. Check (tiny models, bf16): the transformer output each rank computes, with xfuser's USP and with ours
   (`streamfusion_diffusers.xdit.enable`, every method and "auto"), against the unparallelized diffusers
   model's matching slice; text split over the SP ranks and text whole on every rank (an odd max_sequence_length).
2. Time (real-size, random weights), one pipeline step per variant, variants round-robin, min / median / max of
   the slowest rank's CUDA-event times, ratios to the first variant, and each variant's transformer output
   against the first's. Real 1 x P (default): xfuser's USP against ours (usp at xfuser's degrees, torus, auto)
   on Flux.1-dev 2048 px and CogVideoX-5b 49 frames (480x720, CFG batch 2). Emulated (--emulate-link L): P
   virtual machines of one GPU, our transports slowed to link L (xfuser's own traffic is not), our USP (U1R<P>:
   Ulysses inside the one-GPU machines, Ring across; and at xfuser's degrees) against our Torus and auto, on
   Flux.1-dev 4096 px and CogVideoX-5b 161 frames.
Prints tables (rank 0); writes them to OUT/xdit_pipeline_<layout>[-<link>-<N>x<M>].json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
from typing import Any

import torch
import torch.distributed as dist

from streamfusion_diffusers import xdit
from streamfusion_diffusers.commands.timing import Stats, deadline, time_ms
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.models.build import build_pipeline

TOLERANCE = 2e-2  # relative error of a bf16 transformer output against the bf16 unparallelized model
REAL_TOLERANCE = 5e-2  # the same between two variants of a real-size random-weight model (deeper: more rounding)
CHECKS = [("tiny-flux", 16), ("tiny-flux", 15), ("tiny-cogvideox", 10), ("tiny-cogvideox", 9)]  # (model, text)
TIMED = ("flux-dev", "cogvideox-5b")


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def first_tensor(x: Any) -> torch.Tensor:
    """The sample in whatever a transformer returned: a tensor, an output object, or nested tuples."""
    while not isinstance(x, torch.Tensor):
        x = x[0] if isinstance(x, (tuple, list)) else x.sample
    return x


def call_args(name: str, text: int, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = MODELS[name]
    args = {"prompt": "a red fox in fresh snow", "height": spec.height, "width": spec.width,
            "num_inference_steps": 1, "output_type": "latent", "max_sequence_length": text}
    if spec.family == "cogvideox":
        args.update(num_frames=spec.frames, guidance_scale=spec.guidance_scale)
    return {**args, **overrides}


def transformer_output(pipe: Any, args: dict[str, Any]) -> torch.Tensor:
    """This rank's transformer output of one pipeline call (the first denoising step), same seed every time."""
    seen: list[torch.Tensor] = []
    handle = pipe.transformer.register_forward_hook(lambda _m, _a, out: seen.append(first_tensor(out).clone()))
    try:
        pipe(**args, generator=torch.Generator("cuda").manual_seed(0))
    finally:
        handle.remove()
    return seen[0]


def quiet(pipe: Any) -> Any:
    """No progress bar from every rank at every call (xfuser's pipelines use the wrapped pipeline's)."""
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wrap(pipe: Any, engine_config: Any) -> Any:
    from xfuser import xFuserCogVideoXPipeline, xFuserFluxPipeline

    family = "flux" if type(pipe).__name__ == "FluxPipeline" else "cogvideox"
    return (xFuserFluxPipeline if family == "flux" else xFuserCogVideoXPipeline)(pipe, engine_config)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(name: str, text: int, engine_config: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from xfuser.core.distributed import get_sequence_parallel_rank, get_sequence_parallel_world_size

    family = MODELS[name].family
    pipe = quiet(build_pipeline(name, dtype=torch.bfloat16, device="cuda"))
    call = call_args(name, text, {})
    reference = transformer_output(pipe, call)  # the whole model on one GPU, before xfuser wraps it
    xpipe = wrap(pipe, engine_config)  # wrapping the first pipeline makes xfuser's parallel groups
    sp, sp_rank = get_sequence_parallel_world_size(), get_sequence_parallel_rank()
    if engine_config.parallel_config.cfg_degree > 1:
        reference = reference.chunk(2, dim=0)[dist.get_rank() // sp]
    expected = reference.chunk(sp, dim=1 if family == "flux" else 3)[sp_rank]
    outputs = {"xfuser-usp": transformer_output(xpipe, call)}
    for method in args.methods:
        xdit.enable(xpipe, method=method, machines=args.machines, backend=args.backend)
        outputs[method] = transformer_output(xpipe, call)
        xdit.disable(xpipe)
    rows = []
    for variant, out in outputs.items():
        errors = torch.tensor([rel(out, expected), rel(out, outputs["xfuser-usp"])], device="cuda")
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        rows.append({"model": name, "text": text, "variant": variant, "vs_unparallel": errors[0].item(),
                     "vs_xfuser": errors[1].item(), "ok": errors[0].item() <= TOLERANCE})
    del xpipe, pipe
    return rows


def variant_options(variant: str) -> dict[str, Any] | None:
    """enable() keywords of a variant: 'xfuser' (its own USP: None), 'METHOD' (at xfuser's degrees, or chosen
    by 'auto') or 'METHOD:U<u>R<r>' (our degrees)."""
    if variant == "xfuser":
        return None
    method, _, degrees = variant.partition(":")
    found = re.fullmatch(r"U(\d+)R(\d+)", degrees)
    if degrees and not found:
        raise SystemExit(f"variant {variant!r}: write METHOD or METHOD:U<u>R<r>, e.g. usp:U1R2")
    return {"method": method, **({"ulysses": int(found[1]), "ring": int(found[2])} if found else {})}


def timed_call(workload: str, guidance_scale: float | None) -> tuple[str, dict[str, Any]]:
    """(model, call arguments) of 'flux-dev:PIXELS' or 'cogvideox-5b:FRAMES' (at the model's 480 x 720)."""
    name, _, size = workload.partition(":")
    if name not in TIMED or not size.isdigit():
        raise SystemExit(f"workload {workload!r}: write flux-dev:PIXELS or cogvideox-5b:FRAMES")
    spec = MODELS[name]
    overrides = {"height": int(size), "width": int(size)} if spec.family == "flux" else {"num_frames": int(size)}
    if spec.family == "cogvideox" and guidance_scale is not None:
        overrides["guidance_scale"] = guidance_scale
    return name, call_args(name, spec.max_sequence_length, overrides)


def timed(workload: str, engine_config: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One pipeline step of every variant, round-robin (warm-up rounds, then timed ones; each the slowest rank's
    CUDA-event time), and each variant's first transformer output against the first variant's."""
    name, call = timed_call(workload, args.guidance_scale)
    xpipe = wrap(quiet(build_pipeline(name, dtype=torch.bfloat16, device="cuda")), engine_config)
    step = lambda: xpipe(**call, generator=torch.Generator("cuda").manual_seed(0))  # noqa: E731
    device = torch.device("cuda", torch.cuda.current_device())
    options = {v: variant_options(v) for v in args.variants}
    extra = {"machines": args.machines, "backend": args.backend, "emulate_link": args.emulate_link}
    times: dict[str, list[float]] = {v: [] for v in options}
    outputs: dict[str, torch.Tensor] = {}
    for i in range(1 + args.warmup + args.iters):  # round 0 keeps the outputs (and warms up)
        for variant, opts in options.items():
            if opts is not None:
                xdit.enable(xpipe, **extra, **opts)
            if i == 0:
                outputs[variant] = transformer_output(xpipe, call)
            elif i <= args.warmup:
                step()
            else:
                times[variant] += time_ms(step, 1, 0, device)
            if opts is not None:
                xdit.disable(xpipe)
    first = args.variants[0]
    rows = []
    for variant, kept in times.items():
        error = torch.tensor([rel(outputs[variant], outputs[first])], device="cuda")
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        stats = Stats.of(kept)
        rows.append({"workload": workload, "variant": variant, **stats.row(), "vs_first": error.item(),
                     "ok": error.item() <= REAL_TOLERANCE})
    for row in rows:
        row["ratio"] = row["ms"] / rows[0]["ms"]
    return rows


def print_timings(rows: list[dict[str, Any]]) -> None:
    """One workload's rows and headlines (rank 0)."""
    log(f"{'workload':18} {'variant':12} {'min ms':>9} {'median':>9} {'max ms':>9} {'/ first':>8} {'rel.err':>8}  ok")
    for r in rows:
        log(f"{r['workload']:18} {r['variant']:12} {r['min_ms']:9.1f} {r['ms']:9.1f} {r['max_ms']:9.1f} "
            f"{r['ratio']:8.3f} {r['vs_first']:8.1e}  {'PASS' if r['ok'] else 'FAIL'}")
    for line in headlines(rows):
        log(f"{rows[0]['workload']}: {line}")


def headlines(rows: list[dict[str, Any]]) -> list[str]:
    """The comparisons the issue asks for: ours at its best against xfuser's USP; Torus against our USP."""
    def best(pick: Any) -> dict[str, Any] | None:
        return min(filter(pick, rows), key=lambda r: r["ms"], default=None)

    ours, xfuser = best(lambda r: r["variant"] != "xfuser"), best(lambda r: r["variant"] == "xfuser")
    torus, usp = best(lambda r: r["variant"].startswith("torus")), best(lambda r: r["variant"].startswith("usp"))
    auto = best(lambda r: r["variant"] == "auto")
    pairs = [("ours best", ours, "xfuser", xfuser), ("auto", auto, "xfuser", xfuser), ("torus", torus, "usp best", usp)]
    return [f"{a} ({x['variant']}) {x['ms']:.1f} ms vs {b} ({y['variant']}) {y['ms']:.1f} ms: "
            f"{y['ms'] / x['ms']:.3f}x faster"
            for a, x, b, y in pairs if x is not None and y is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--ring-degree", type=int, default=1)
    parser.add_argument("--use-cfg-parallel", action="store_true")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["ulysses", "ring", "usp", "torus", "auto"],
                        help="our methods the tiny checks run")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=None,
                        help="timed: xfuser (its USP), METHOD or METHOD:U<u>R<r>; the first is the baseline "
                             "(default: xfuser,usp,torus,auto; emulated: usp:U1R<P>,usp,torus,auto)")
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=None,
                        help="timed: flux-dev:PIXELS, cogvideox-5b:FRAMES (default: flux-dev:2048,cogvideox-5b:49; "
                             "emulated: flux-dev:4096,cogvideox-5b:161)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="CogVideoX (default 6: CFG batch 2)")
    parser.add_argument("--emulate-link", default=None, help="our transports slowed to this link (p4de, dgx, ...)")
    parser.add_argument("--machines", type=int, default=None,
                        help="machines our layouts see (default: 1; emulated: one per GPU)")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=0, help="untimed rounds after the first (which keeps outputs)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=450)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from xfuser import xFuserArgs

    engine_config, _ = xFuserArgs(model="random-weights", ulysses_degree=args.ulysses_degree,
                                  ring_degree=args.ring_degree, use_cfg_parallel=args.use_cfg_parallel).create_config()
    world = dist.get_world_size()
    emulated = args.emulate_link is not None
    args.machines = args.machines or (world if emulated else 1)
    args.variants = args.variants or ([f"usp:U1R{world}", "usp", "torus", "auto"] if emulated
                                      else ["xfuser", "usp", "torus", "auto"])
    args.workloads = args.workloads or (["flux-dev:4096", "cogvideox-5b:161"] if emulated
                                        else ["flux-dev:2048", "cogvideox-5b:49"])
    layout = f"U{args.ulysses_degree}R{args.ring_degree}" + ("-cfg2" if args.use_cfg_parallel else "")
    tag = layout + (f"-{args.emulate_link}-{args.machines}x{world // args.machines}" if emulated else "")
    results: dict[str, Any] = {"xfuser_layout": layout, "world": world, "emulate_link": args.emulate_link,
                               "machines": args.machines, "checks": [], "timings": []}
    cfg = engine_config.parallel_config.cfg_degree > 1
    runs = lambda name: not (cfg and MODELS[name].family == "flux")  # noqa: E731 - xFuserFluxPipeline has no CFG split

    def save() -> None:  # after every part, so that a job cut short still leaves what it measured
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"xdit_pipeline_{tag}.json"), "w") as f:
                json.dump(results, f, indent=1)

    with deadline(args.deadline_s):
        if not args.skip_checks:
            for name, text in filter(lambda c: runs(c[0]), CHECKS):
                results["checks"] += check(name, text, engine_config, args)
                gc.collect()
                torch.cuda.empty_cache()
            save()
            log(f"\nxfuser {layout} on {world} GPUs, tiny models, bf16: rel. error of each rank's transformer output "
                f"(max over ranks)")
            log(f"{'model':16} {'text':>4} {'attention':11} {'vs unparallel':>13} {'vs xfuser':>10}  ok")
            for r in results["checks"]:
                log(f"{r['model']:16} {r['text']:4d} {r['variant']:11} {r['vs_unparallel']:13.2e} "
                    f"{r['vs_xfuser']:10.2e}  {'PASS' if r['ok'] else 'FAIL'}")
        if not args.skip_timing:
            where = (f"{args.machines} x {world // args.machines} emulated, {args.emulate_link} link (ours only)"
                     if emulated else f"1 x {world}")
            log(f"\nxfuser {layout}, {where}: one pipeline step (random weights, bf16), ms of the slowest rank over "
                f"{args.iters} rounds; rel.err: transformer output vs the first variant")
            for workload in filter(lambda w: runs(w.split(":")[0]), args.workloads):
                rows = timed(workload, engine_config, args)
                results["timings"] += rows
                save()
                print_timings(rows)
                gc.collect()
                torch.cuda.empty_cache()
    failed = [r for r in results["checks"] if not r["ok"] and r["variant"] != "xfuser-usp"]
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"{len(failed)} check(s) of our attention failed")


if __name__ == "__main__":
    main()

"""xfuser's own Flux and CogVideoX pipelines with its USP attention, then with ours (issue 12), on P GPUs.

    torchrun --nproc-per-node 2 benchmarks/xdit_pipeline.py --ulysses-degree 2 --ring-degree 1 --out "$OUT"

xfuser makes its process groups once per process, so one run is one xfuser layout (--ulysses-degree x
--ring-degree, optionally --use-cfg-parallel); our methods are all tried inside it. Every model is a diffusers
pipeline built offline with random weights (models/build.py), wrapped by xFuserFluxPipeline /
xFuserCogVideoXPipeline as xfuser's from_pretrained would, and called as xfuser's examples call it (one
denoising step, latent output, the same seed for every variant).
1. Check (tiny models, bf16): the transformer output each rank computes, with xfuser's USP and with ours
   (`streamfusion_diffusers.xdit.enable`, every method), against the unparallelized diffusers model's matching
   slice; text split over the SP ranks and text whole on every rank (an odd max_sequence_length).
2. Time (real-size, random weights): Flux.1-dev 2048 px and CogVideoX-5b 49 frames (480x720, CFG batch 2): the
   pipeline step, median of CUDA-event times of the slowest rank, xfuser's USP against ours.
Prints a table (rank 0); writes it to OUT/xdit_pipeline_U<u>R<r>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from streamfusion_diffusers import xdit
from streamfusion_diffusers.bench.timing import deadline, time_ms
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.models.build import build_pipeline

TOLERANCE = 2e-2  # relative error of a bf16 transformer output against the bf16 unparallelized model
CHECKS = [("tiny-flux", 16), ("tiny-flux", 15), ("tiny-cogvideox", 10), ("tiny-cogvideox", 9)]  # (model, text)
TIMED = {"flux-dev": {"height": 2048, "width": 2048}, "cogvideox-5b": {}}


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
            "num_inference_steps": 1, "output_type": "latent", "max_sequence_length": text, **overrides}
    if spec.family == "cogvideox":
        args.update(num_frames=spec.frames, guidance_scale=spec.guidance_scale)
    return args


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
    sp, sp_rank = get_sequence_parallel_world_size(), get_sequence_parallel_rank()
    if engine_config.parallel_config.cfg_degree > 1:
        reference = reference.chunk(2, dim=0)[dist.get_rank() // sp]
    expected = reference.chunk(sp, dim=1 if family == "flux" else 3)[sp_rank]
    xpipe = wrap(pipe, engine_config)
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


def timed(name: str, engine_config: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = MODELS[name]
    pipe = quiet(build_pipeline(name, dtype=torch.bfloat16, device="cuda"))
    xpipe = wrap(pipe, engine_config)
    call = call_args(name, spec.max_sequence_length, TIMED[name])
    step = lambda: xpipe(**call, generator=torch.Generator("cuda").manual_seed(0))  # noqa: E731
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [{"model": name, "variant": "xfuser-usp", "ms": statistics.median(time_ms(step, args.iters, 1, device))}]
    for method in args.methods:
        xdit.enable(xpipe, method=method, machines=args.machines, backend=args.backend)
        rows.append({"model": name, "variant": method, "ms": statistics.median(time_ms(step, args.iters, 1, device))})
        xdit.disable(xpipe)
    for row in rows:
        row["vs_xfuser"] = row["ms"] / rows[0]["ms"]
    del xpipe, pipe
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ulysses-degree", type=int, default=2)
    parser.add_argument("--ring-degree", type=int, default=1)
    parser.add_argument("--use-cfg-parallel", action="store_true")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=["ulysses", "ring", "usp", "torus"])
    parser.add_argument("--machines", type=int, default=1)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from xfuser import xFuserArgs

    engine_config, _ = xFuserArgs(model="random-weights", ulysses_degree=args.ulysses_degree,
                                  ring_degree=args.ring_degree, use_cfg_parallel=args.use_cfg_parallel).create_config()
    layout = f"U{args.ulysses_degree}R{args.ring_degree}" + ("-cfg2" if args.use_cfg_parallel else "")
    results: dict[str, Any] = {"xfuser_layout": layout, "world": dist.get_world_size(), "checks": [], "timings": []}
    cfg = engine_config.parallel_config.cfg_degree > 1
    runs = lambda name: not (cfg and MODELS[name].family == "flux")  # noqa: E731 - xFuserFluxPipeline has no CFG split
    with deadline(540):
        for name, text in filter(lambda c: runs(c[0]), CHECKS):
            results["checks"] += check(name, text, engine_config, args)
            gc.collect()
            torch.cuda.empty_cache()
        log(f"\nxfuser {layout} on {dist.get_world_size()} GPUs, tiny models, bf16: rel. error of each rank's "
            f"transformer output (max over ranks)")
        log(f"{'model':16} {'text':>4} {'attention':11} {'vs unparallel':>13} {'vs xfuser':>10}  ok")
        for r in results["checks"]:
            log(f"{r['model']:16} {r['text']:4d} {r['variant']:11} {r['vs_unparallel']:13.2e} {r['vs_xfuser']:10.2e}"
                f"  {'PASS' if r['ok'] else 'FAIL'}")
        if not args.skip_timing:
            for name in filter(runs, TIMED):
                results["timings"] += timed(name, engine_config, args)
                gc.collect()
                torch.cuda.empty_cache()
            log(f"\nxfuser {layout}: one pipeline step (random weights, bf16), median of {args.iters}, slowest rank")
            log(f"{'model':14} {'attention':11} {'ms':>9} {'/ xfuser':>8}")
            for r in results["timings"]:
                log(f"{r['model']:14} {r['variant']:11} {r['ms']:9.1f} {r['vs_xfuser']:8.3f}")
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"xdit_pipeline_{layout}.json"), "w") as f:
            json.dump(results, f, indent=1)
    failed = [r for r in results["checks"] if not r["ok"] and r["variant"] != "xfuser-usp"]
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(f"{len(failed)} check(s) of our attention failed")


if __name__ == "__main__":
    main()

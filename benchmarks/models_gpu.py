"""Each real-size new model's transformer forward on one GPU through `parallelize` (P = 1), bf16, random weights.

Prints one line per model (step time, peak memory) and writes them as JSON to --out. Text encoders are not run:
the transformer gets random prompt embeddings of the real width and length (Flux.2-dev's 24B Mistral encoder would
not fit beside its 32B transformer; a real run encodes first and frees it). Launch with torchrun (see
benchmarks/models_gpu.sh).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from streamfusion_diffusers import ParallelConfig, ParallelContext, init_parallel
from streamfusion_diffusers.context import shutdown
from streamfusion_diffusers.models import TRANSFORMERS
from streamfusion_diffusers.models.inputs import build, inputs
from streamfusion_diffusers import parallelize

MODELS = ("wan2.2-ti2v-5b", "qwen-image", "flux2-dev", "wan2.2-t2v-a14b")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(name: str, repeats: int, ctx: ParallelContext, device: torch.device) -> dict:
    spec, dtype = TRANSFORMERS[name], torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = build(spec.family, spec.transformer, dtype=dtype, device=device)
    built = time.perf_counter() - start
    weights = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the forward's peak apart from the build's
    args = inputs(spec.family, spec.transformer, spec.grid, spec.text, dtype=dtype, device=device)
    parallelize(model, ctx)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up (kernel choice, allocator)
            _sync(device)
            t = time.perf_counter()
            model(**args, return_dict=False)
            _sync(device)
            times.append(time.perf_counter() - t)
    tokens = 1
    for side in spec.grid:
        tokens *= side
    row = {"model": name, "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
           "image_tokens": tokens, "text_tokens": spec.text, "step_s": round(min(times[1:]), 3),
           "weights_gib": round(weights / 2**30, 1) if device.type == "cuda" else None,
           "forward_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
           "build_s": round(built, 1), "text_encoder": "not run (random prompt embeddings)",
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    del model, args
    gc.collect()  # the hooks and the transformer reference each other: freed by the collector, not by del
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=sorted(TRANSFORMERS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=420, help="skip the models left after this long")
    parser.add_argument("--out", default="models_gpu.json")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the tiny-* models")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    ctx = init_parallel(ParallelConfig(method="ulysses", backend="torch"))
    rows, start = [], time.perf_counter()
    for name in args.models:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"model": name, "skipped": f"over the {args.budget_s:.0f} s budget"})
        else:
            try:
                rows.append(run(name, args.repeats, ctx, device))
            except torch.OutOfMemoryError as err:
                rows.append({"model": name, "error": f"out of memory: {str(err).splitlines()[0]}"})
                torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    shutdown()


if __name__ == "__main__":
    main()

"""What `parallelize` costs at P = 1, against plain diffusers, eager and compiled alike, on one GPU.

Real configs, seeded random weights, bf16, one transformer forward per timing. One copy of each model (Flux.2-dev's
32B transformer fits one 80 GB GPU once, not twice), switched between plain (as built) and ours (`parallelize` on a
one-rank NCCL job, every attention through `sp_attention`) before each round; rounds alternate, so drift hits both
alike; CUDA events around each forward, after warm-up (and compile):

- eager: no compile;
- blocks: `model.compile_repeated_blocks(fullgraph=True)` (diffusers' regional compile; Dynamo keeps a graph for
  each state, the hooks and processors being what its guards see).

    python benchmarks/p1_overhead.py --models flux2-dev,qwen-image,wan2.2-ti2v-5b --modes eager,blocks

--quantize fp8-dynamic quantizes the one model both run (plain diffusers + torchao beside ours + torchao);
--kernel int8 or fp8 gives ours the quantized attention.

Prints one line per model and mode (median ms of plain and ours, ratio ours / plain, min - max, error of ours
against plain) and writes every figure to $OUT/p1_overhead_<label>.json (or the current folder). --label names
the code that ran (the script runs against any checkout of the package with the same API: before and after).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.diffusers.stack.quantize import quantize
from streamfusion_diffusers.models import TRANSFORMERS
from streamfusion_diffusers.models.inputs import build, inputs

MODES = ("eager", "blocks")


def timed(call, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls, by CUDA events around each (the host clock on the CPU)."""
    times = []
    for _ in range(iters):
        if device.type != "cuda":
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def relative(a: torch.Tensor | list[torch.Tensor], b: torch.Tensor | list[torch.Tensor]) -> float:
    """Relative error of a against b; Z-Image's forward returns one sample per batch row, in a list."""
    a, b = (torch.stack(x) if isinstance(x, list) else x for x in (a, b))
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(name: str, modes: list[str], ctx: Any, iters: int, rounds: int, device: torch.device,
            quantized: str | None = None) -> dict:
    """Plain vs ours for one model, every mode, as the module docstring says; `quantized`: `--quantize`'s kind,
    applied to the one model both run (plain diffusers + torchao beside ours + torchao)."""
    spec = TRANSFORMERS[name]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(spec.family, spec.transformer, dtype=dtype, device=device)
    if quantized:
        quantize([model], quantized)
    args = inputs(spec.family, spec.transformer, spec.grid, spec.text, dtype=dtype, device=device)
    forward = lambda: model(**args, return_dict=False)[0]  # noqa: E731
    state = {"ours": False}

    def become(ours: bool) -> None:
        if ours and not state["ours"]:
            parallelize(model, ctx)
        elif state["ours"] and not ours:
            unparallelize(model)
        state["ours"] = ours

    row: dict[str, Any] = {"model": name, "grid": list(spec.grid), "text_tokens": spec.text, "quantize": quantized,
                           "modes": {}}
    with torch.no_grad():
        for mode in modes:
            t0 = time.perf_counter()
            if mode == "blocks":
                torch._dynamo.reset()
                model.compile_repeated_blocks(fullgraph=True, dynamic=False,
                                              backend="inductor" if cuda else "aot_eager")
            outs = {}
            for who in ("plain", "ours"):
                become(who == "ours")
                for _ in range(3):  # compile (blocks) and warm-up: kernel choice, allocator
                    outs[who] = forward()
            times: dict[str, list[float]] = {"plain": [], "ours": []}
            for _ in range(rounds):
                for who in times:
                    become(who == "ours")
                    forward()  # one untimed call after the switch
                    times[who] += timed(forward, iters, device)
            med = {w: statistics.median(t) for w, t in times.items()}
            row["modes"][mode] = {
                "ms": {w: {"min": min(t), "median": med[w], "max": max(t), "samples": t} for w, t in times.items()},
                "ratio_ours_over_plain": med["ours"] / med["plain"],
                "error_ours_vs_plain": relative(outs["ours"], outs["plain"]),
                "mode_s": time.perf_counter() - t0}
            print(f"{name:16s} {mode:6s} plain {med['plain']:8.2f} ({min(times['plain']):.2f}-"
                  f"{max(times['plain']):.2f}) ours {med['ours']:8.2f} ({min(times['ours']):.2f}-"
                  f"{max(times['ours']):.2f}) ratio {med['ours'] / med['plain']:.4f} "
                  f"err {row['modes'][mode]['error_ours_vs_plain']:.1e} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            if mode == "blocks":  # the blocks eager again for the next mode
                for block in model.modules():
                    if type(block).__name__ in (model._repeated_blocks or ()):
                        block._compiled_call_impl = None
    become(False)
    del model, args
    gc.collect()  # the hooks and the transformer reference each other: freed by the collector, not by del
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="flux2-dev,qwen-image,wan2.2-ti2v-5b")
    parser.add_argument("--modes", default="eager,blocks")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="after")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip the models left after this long")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (e.g. --models tiny-flux2)")
    parser.add_argument("--kernel", default="auto", help="ParallelConfig.kernel of ours")
    parser.add_argument("--quantize", choices=("int8", "fp8", "fp8-dynamic"),
                        help="torchao quantization of the model, for plain and ours alike (generate's --quantize)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    ctx = init_parallel(ParallelConfig(method="ulysses", kernel=args.kernel))
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {"label": args.label, "device": device_name, "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "iters": args.iters,
                               "rounds": args.rounds, "kernel": args.kernel, "quantize": args.quantize, "rows": []}
    start = time.perf_counter()
    for name in [m for m in args.models.split(",") if m]:
        if time.perf_counter() - start > args.budget_s:
            results["rows"].append({"model": name, "skipped": f"over the {args.budget_s:.0f} s budget"})
            print(f"{name}: skipped, over the budget", flush=True)
            continue
        results["rows"].append(measure(name, modes, ctx, args.iters, args.rounds, device, args.quantize))
    path = os.path.join(os.environ.get("OUT", "."), f"p1_overhead_{args.label}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Issue 25, item 2: ours compiled like diffusers users compile, against plain diffusers compiled the same way, at
P = 1 on one GPU. Real configs, seeded random weights, bf16, one transformer forward per timing.

Two copies of the model with the same weights: plain diffusers, and ours (`parallelize` on a one-rank NCCL job, so
every attention runs through `sp_attention`, under torch.compile the custom op `streamfusion::sp_attention`). For
each mode both are compiled the same way and timed in alternating rounds (CUDA events, warm-up first):

- eager: no compile;
- blocks: `model.compile_repeated_blocks(fullgraph=True)` (diffusers' regional compile; Flux only: CogVideoX
  declares no repeated blocks);
- whole: `torch.compile(model, fullgraph=True)`;
- whole-ro: the same with mode="reduce-overhead" (CUDA graphs).

    python benchmarks/compile_bench.py --workload flux-dev:1024 --modes eager,blocks,whole
    python benchmarks/compile_bench.py --workload cogvideox-5b:49x480x720 --modes eager,whole

Prints one line per mode (median ms of plain and ours, ratio, min/max, errors) and writes every figure to
$OUT/compile_bench_<workload>.json (or the current folder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import cogvideox, flux
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers import parallelize

MODES = ("eager", "blocks", "whole", "whole-ro")


def workload(spec: str):
    """flux-dev:<px> or cogvideox-5b:<frames>x<height>x<width>."""
    name, size = spec.split(":")
    if name == "flux-dev":
        return flux(int(size))
    frames, height, width = (int(x) for x in size.split("x"))
    return cogvideox(frames, height, width)


def timed(call, iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls, by CUDA events around each."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def compiled(model: torch.nn.Module, mode: str):
    """The callable that runs `model` compiled as `mode` asks (diffusers' user-facing calls)."""
    if mode == "eager":
        return model
    if mode == "blocks":
        model.compile_repeated_blocks(fullgraph=True, dynamic=False)
        return model
    return torch.compile(model, fullgraph=True, dynamic=False,
                         mode="reduce-overhead" if mode == "whole-ro" else None)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="flux-dev:1024")
    parser.add_argument("--modes", default="eager,blocks,whole")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    w = workload(args.workload)
    device, dtype = torch.device("cuda"), torch.bfloat16
    plain = build_transformer(w.model, seed=0, dtype=dtype, device=device)
    ours = build_transformer(w.model, seed=0, dtype=dtype, device=device)
    parallelize(ours, init_parallel(ParallelConfig(method="ulysses")))
    inputs = model_inputs(w, plain.config, 1, dtype, device)
    results: dict[str, Any] = {"workload": w.name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "modes": {}}
    with torch.no_grad():
        reference = plain(**inputs)[0].clone()
        for mode in modes:
            torch._dynamo.reset()
            if mode == "blocks" and not plain._repeated_blocks:
                print(f"{mode:9s} skipped: {type(plain).__name__} declares no repeated blocks", flush=True)
                continue
            calls, outs, compile_s = {}, {}, {}
            for name, model in (("plain", plain), ("ours", ours)):
                t0 = time.perf_counter()
                calls[name] = compiled(model, mode)
                for _ in range(3):  # compile (first call), then warm-up (CUDA graph trees record at the 2nd/3rd)
                    out = calls[name](**inputs)[0]
                torch.cuda.synchronize()
                outs[name], compile_s[name] = out.clone(), time.perf_counter() - t0
            times: dict[str, list[float]] = {"plain": [], "ours": []}
            for _ in range(args.rounds):  # alternating rounds: drift hits both alike
                for name in times:
                    times[name] += timed(lambda: calls[name](**inputs), args.iters)
            med = {n: statistics.median(t) for n, t in times.items()}
            row = {"ms": {n: {"min": min(t), "median": med[n], "max": max(t)} for n, t in times.items()},
                   "ratio_ours_over_plain": med["ours"] / med["plain"], "compile_s": compile_s,
                   "error_ours_vs_plain": relative(outs["ours"], outs["plain"]),
                   "error_plain_vs_eager": relative(outs["plain"], reference),
                   "error_ours_vs_eager": relative(outs["ours"], reference)}
            results["modes"][mode] = row
            print(f"{mode:9s} plain {med['plain']:8.2f} ({min(times['plain']):.2f}-{max(times['plain']):.2f}) "
                  f"ours {med['ours']:8.2f} ({min(times['ours']):.2f}-{max(times['ours']):.2f}) "
                  f"ratio {row['ratio_ours_over_plain']:.4f}  err ours/plain {row['error_ours_vs_plain']:.1e} "
                  f"compile s {compile_s['plain']:.0f}/{compile_s['ours']:.0f}", flush=True)
            if mode == "blocks":  # run the blocks eager again for the next mode
                for model in (plain, ours):
                    for block in model.modules():
                        if type(block).__name__ in model._repeated_blocks:
                            block._compiled_call_impl = None
    path = os.path.join(os.environ.get("OUT", "."), f"compile_bench_{args.workload.replace(':', '_')}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

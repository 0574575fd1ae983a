"""Sharded weights (`parallelize(..., shard_weights=True)`) against whole ones: a real-size transformer's step time
and per-GPU memory, eager and compiled, beside `plan --memory`'s estimate of the same (the transformer's part).

One torchrun job (P = its world size, ulysses 1 x P): per workload the transformer is built once (bf16, random
weights, on the GPU), its blocks compiled regionally (`compile_repeated_blocks(fullgraph=True)`, lazily), then
parallelized with whole weights: eager (`torch.compiler.set_stance("force_eager")`) and compiled steps timed;
then unparallelized and parallelized again with sharded weights (the whole copy freed), timed the same way. Per
row: the median step of the slowest rank, the peak and the memory held between forwards (the largest rank's), the
estimate. Also whether FSDP2 runs under torch.inference_mode() with this torch (fixed in pytorch#197327, 2026-09).
One JSON line per row on stdout, all rows in --out. Launch: benchmarks/shard_gpu.sh, benchmarks/shard_multigpu.sh.
--profile adds where one more step's GPU time goes (rank 0's) (`profile_step`: per stream busy time, top kernels).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, ParallelContext, init_parallel
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.context import shutdown
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize, unparallelize
from streamfusion_diffusers.diffusers.sharded_weights import held_bytes
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.models.memory import GIB, estimate, pipeline_parts

GPU_WORKLOADS = ("flux-dev:1024", "qwen-image:1328", "flux2-dev:1024", "wan2.2-t2v-a14b:81:480:832")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _worst(value: float) -> float:
    """The largest value over the ranks (the slowest step, the fullest GPU)."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _steps(model: torch.nn.Module, inputs: dict, repeats: int, warmup: int, device: torch.device) -> float:
    with torch.no_grad():
        times = []
        for i in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            model(**inputs)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return _worst(statistics.median(times))


def profile_step(model: torch.nn.Module, inputs: dict, device: torch.device) -> dict:
    """Where one step's GPU time goes (one profiled forward, this rank): per CUDA stream its busy time (kernels,
    copies and memsets, overlaps merged) and its largest kernels, beside the step's wall time. The compute stream's
    busy time against the wall says how long it stood waiting (for a gather, or for the host); FSDP2's copy-out of
    each gathered block runs on it too (split_with_sizes_copy). And the host's ops by self time (synchronizing
    calls among them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        _sync(device)
        start = time.perf_counter()
        model(**inputs)
        _sync(device)
        wall_ms = 1e3 * (time.perf_counter() - start)
    spans: dict[int, list[tuple[int, int]]] = {}
    kernels: dict[int, dict[str, float]] = {}
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        stream = event.device_resource_id()
        spans.setdefault(stream, []).append((event.start_ns(), event.end_ns()))
        names = kernels.setdefault(stream, {})
        names[event.name()[:70]] = names.get(event.name()[:70], 0.0) + event.duration_ns() / 1e6
    streams = {}
    for stream, intervals in spans.items():
        busy, end = 0, 0
        for lo, hi in sorted(intervals):
            busy += max(0, hi - max(lo, end))
            end = max(end, hi)
        top = sorted(kernels[stream].items(), key=lambda kv: -kv[1])[:6]
        streams[str(stream)] = {"busy_ms": round(busy / 1e6, 2), "top_ms": {n: round(ms, 2) for n, ms in top}}
    host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()),
                  key=lambda kv: -kv[1])[:10]  # where the host spent the step (the GPU waits when it is the bound)
    return {"wall_ms": round(wall_ms, 1), "streams": streams,
            "host_self_ms": {f"{name[:60]} x{count}": round(ms, 2) for name, ms, count in host}}


def inference_mode_probe(device: torch.device) -> str:
    """Whether a plain FSDP2 Linear (none of our guards) runs under torch.inference_mode() on this torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if dist.get_world_size() == 1:
        return "one rank: not probed"
    layer = fully_shard(torch.nn.Linear(64, 64, device=device),
                        mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    try:
        with torch.inference_mode():
            layer(torch.ones(2, 64, device=device))
        return "runs"
    except RuntimeError as err:
        return f"fails: {str(err).splitlines()[0]}"


def run(spec: str, repeats: int, modes: list[str], ctx: ParallelContext, device: torch.device,
        profiled: bool = False) -> list[dict]:
    workload = parse_workload(spec)
    name, world = workload.model, dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not name.startswith("tiny-") and device.type == "cpu":
        name = {"flux-dev": "tiny-flux", "qwen-image": "tiny-qwen-image", "flux2-dev": "tiny-flux2",
                "wan2.2-t2v-a14b": "tiny-wan-a14b"}[name]  # the CPU dry run: the tiny stand-ins
    model = build_transformer(name, dtype=dtype, device=device)
    config = dict(model.config)
    inputs = model_inputs(workload if device.type == "cuda" else _tiny(workload, name), config, 1, dtype, device)
    if "compiled" in modes:
        model.compile_repeated_blocks(fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    parts = pipeline_parts(name) if device.type == "cuda" else None
    rows = []
    for shard in (False, True):
        parallelize(model, ctx, shard_weights=shard)
        gc.collect()
        for mode in modes:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row = {"workload": workload.name, "model": name, "ranks": world, "sharded": shard, "mode": mode}
            try:  # a compile failure (the same on every rank) is a row, and the job goes on
                with torch.compiler.set_stance("force_eager" if mode == "eager" else "default"):
                    row["step_ms"] = round(1e3 * _steps(model, inputs, repeats, 1 if mode == "eager" else 2, device), 1)
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            if profiled and "error" not in row:  # every rank profiles the step (its collectives need the peers)
                with torch.compiler.set_stance("force_eager" if mode == "eager" else "default"):
                    profiled_step = profile_step(model, inputs, device)
                if dist.get_rank() == 0:
                    row["profile"] = profiled_step
            held, whole = held_bytes([model])
            row.update(weights_held_gib=round(_worst(held) / GIB, 2), weights_whole_gib=round(whole / GIB, 2))
            if device.type == "cuda":
                row["peak_gib"] = round(_worst(torch.cuda.max_memory_allocated()) / GIB, 2)
                row["between_forwards_gib"] = round(_worst(torch.cuda.memory_allocated()) / GIB, 2)
                e = estimate(name, *_size(workload), world, sharded=shard, parts=parts)
                row["planned_gib"] = round(parts["transformer"].total / (world if shard else 1) / GIB + e.gathered
                                           + e.activations + e.attention, 2)
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
        if not shard:
            unparallelize(model)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _size(workload) -> tuple[int, int, int]:
    frames, height, width = workload.size
    return height, width, frames


def _tiny(workload, name: str):
    """The CPU dry run's workload: the tiny model at a small size."""
    spec = {"tiny-flux": "flux-dev:64", "tiny-qwen-image": "qwen-image:64", "tiny-flux2": "flux2-dev:64",
            "tiny-wan-a14b": "wan2.2-t2v-a14b:9:64:64"}[name]
    small = parse_workload(spec)
    return dataclasses.replace(small, model="tiny-wan" if name == "tiny-wan-a14b" else name)  # its inputs' spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=list(GPU_WORKLOADS))
    parser.add_argument("--modes", default="eager", help="eager, compiled or eager,compiled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400, help="skip the workloads left after this long")
    parser.add_argument("--out", default="shard.json")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the tiny stand-ins over gloo")
    parser.add_argument("--profile", action="store_true", help="profile one more step per row (rank 0's streams)")
    args = parser.parse_args()
    device = torch.device(args.device)
    ctx = init_parallel(ParallelConfig(method="ulysses"))  # joins torchrun's job (NCCL on GPUs, gloo on the CPU)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rows: list[dict] = [{"inference_mode_fsdp2": inference_mode_probe(device), "torch": torch.__version__,
                         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}]
    if dist.get_rank() == 0:
        print(json.dumps(rows[0]), flush=True)
    start = time.perf_counter()
    for spec in args.workloads:
        if time.perf_counter() - start > args.budget_s:
            rows.append({"workload": spec, "skipped": f"over the {args.budget_s:.0f} s budget"})
            continue
        try:
            rows += run(spec, args.repeats, args.modes.split(","), ctx, device, args.profile)
        except torch.OutOfMemoryError as err:
            rows.append({"workload": spec, "error": f"out of memory: {str(err).splitlines()[0]}"})
            gc.collect()
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    shutdown(ctx)


if __name__ == "__main__":
    main()

"""Sharded weights (`parallelize(..., shard_weights=True)`) against whole ones: a real-size transformer's step time
and per-GPU memory, eager, in CUDA graphs and compiled, beside `plan --memory`'s estimate (the transformer's part).

One torchrun job (P = its world size) at the layout `method="auto"` picks, as `generate` does by default (--method
forces one). Per workload the transformer (bf16, random weights, built on the GPU) is built once per weight
variant and parallelized so: `whole`; `sharded` (every block streamed); `split`, the planner's partial split for
--max-memory GiB per GPU (`weight_budget` as `generate --shard-weights --max-memory` computes it, without the text
encoders: `choose_split` keeps gathered the most blocks that fit); `tensor` and `tensor-split`, the same two with
the streamed blocks run tensor-parallel (`streamed="tensor"`: their tokens gathered, not their weights). Each variant is timed per mode: `eager`; `graph`,
the forward captured in a CUDA graph (`parallelize(..., cuda_graph=True)`: a shape's first call runs eager, the
second captures, later ones replay; the steady replays are timed, eager kernels); `compiled`
(`compile_repeated_blocks(fullgraph=True)`, inductor). Where graphs are on, the eager and compiled modes pass
through the graph hook (a horizon too short to capture). Without a GPU, graph rows say why they did not run.
Per row: the layout, the step's min / median / max over the repeats (synchronized wall time, each the slowest
rank's), the peak and the memory held between forwards (the fullest GPU's), the weights held, the planned peak;
sharded rows add the split (blocks kept gathered per part: planned and applied). Also whether FSDP2 runs under
torch.inference_mode() with this torch. One JSON line per row on stdout, all rows in --out. Launch:
benchmarks/shard_gpu.sh, benchmarks/shard_multigpu.sh. --profile adds where one more step's GPU time goes (rank
0's) (`profile_step`: per stream busy time, top kernels).
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
from streamfusion_diffusers.diffusers.graphs import check_graphable, graph_hooks, set_horizon
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize
from streamfusion_diffusers.diffusers.sharded_weights import held_bytes
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.runtime.record import layout_record
from streamfusion_diffusers.models.configs import TINY
from streamfusion_diffusers.models.memory import GIB, RUNTIME_GIB, Estimate, estimate, pipeline_parts, weight_budget

GPU_WORKLOADS = ("flux-dev:1024", "qwen-image:1328", "flux2-dev:1024", "wan2.2-t2v-a14b:81:480:832")
MODES = ("eager", "graph", "compiled")
WEIGHTS = ("whole", "sharded", "split", "tensor", "tensor-split")
WARMUP = {"eager": 1, "graph": 3, "compiled": 2}  # graph: a shape's first call eager, the second captures


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _worst(value: float) -> float:
    """The largest value over the ranks (the slowest step, the fullest GPU)."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _steps(model: torch.nn.Module, inputs: dict, repeats: int, warmup: int, device: torch.device
           ) -> list[float]:
    """This rank's seconds per step, after `warmup` untimed steps."""
    with torch.no_grad():
        times = []
        for i in range(warmup + repeats):
            _sync(device)
            start = time.perf_counter()
            model(**inputs)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return times


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


def graph_refusal(ctx: ParallelContext) -> str | None:
    """Why CUDA graphs cannot run in this job (no GPU, a gloo group), or None."""
    try:
        check_graphable(ctx)
    except ValueError as err:
        return str(err)
    return None


def _planned_gib(e: Estimate, vae: int) -> float:
    """The transformer's part of the planned peak: its weights held (the VAE's left out), the gathered slots, one
    block's activations and the attention's buffers."""
    return e.weights - vae / GIB + e.gathered + e.activations + e.attention


def _midway_gib(whole: Estimate, sharded: Estimate) -> float:
    """--max-memory's default: halfway between the planned peaks of whole and fully sharded weights, so the split
    keeps about half the blocks gathered (the runtime's share beside, as `weight_budget` counts it)."""
    return RUNTIME_GIB + (whole.peak + sharded.peak) / 2


def run(spec: str, args: argparse.Namespace, ctx: ParallelContext, device: torch.device) -> list[dict]:
    workload = parse_workload(spec)
    name, world = workload.model, dist.get_world_size()
    if device.type == "cpu" and not name.startswith("tiny-"):
        name = TINY[name]  # the CPU dry run: the tiny stand-in at a small size
    sized = workload if device.type == "cuda" else _tiny(workload, name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes, refused = args.modes.split(","), graph_refusal(ctx)
    parts = {part: sizes for part, sizes in pipeline_parts(name, dtype).items() if part in ("transformer", "vae")}
    vae = parts["vae"].total  # in the plan's budget as in generate's, outside the measured transformer

    def plan(sharded: bool, max_memory: float | None = None, streamed: str = "gather") -> Estimate:
        return estimate(name, *_size(sized), world, sharded=sharded, parts=parts, bytes_per_value=dtype.itemsize,
                        max_memory=max_memory, streamed=streamed)

    max_memory = args.max_memory or _midway_gib(plan(False), plan(True))
    rows = []
    for weights in args.weights.split(","):
        split, streamed = weights.endswith("split"), "tensor" if weights.startswith("tensor") else "gather"
        e = plan(weights != "whole", max_memory if split else None, streamed)
        budget = weight_budget(max_memory, e.activations + e.attention, vae, e.vae_decode) if split else None
        model = build_transformer(name, dtype=dtype, device=device)
        inputs = model_inputs(sized, dict(model.config), 1, dtype, device)
        if "compiled" in modes:
            model.compile_repeated_blocks(fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
        parallelize(model, ctx, cuda_graph="graph" in modes and refused is None, shard_weights=weights != "whole",
                    weight_budget=budget, streamed=streamed)
        gc.collect()
        for mode in modes:
            row = {"workload": workload.name, "model": name, "ranks": world, "weights": weights, "mode": mode}
            if weights != "whole":
                applied = model._streamfusion.split
                row.update(split=e.split, kept=applied.keep if applied is not None else "one rank: whole",
                           received_gib_per_step=round(e.received, 3),
                           tensor_parallel=list(applied.tensor) if applied is not None else [])
            if split:
                row["max_memory_gib"] = round(max_memory, 2)
            if mode == "graph" and refused:
                row["skipped"] = refused
            else:
                row.update(_measure(model, inputs, mode, args, ctx, device))
            held, whole = held_bytes([model])
            row.update(weights_held_gib=round(_worst(held) / GIB, 3), weights_whole_gib=round(whole / GIB, 3),
                       planned_gib=round(_planned_gib(e, vae), 3))
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
        del model, inputs
        gc.collect()
        torch.compiler.reset()  # the compiled blocks hold the freed model's code and guards
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _measure(model: torch.nn.Module, inputs: dict, mode: str, args: argparse.Namespace, ctx: ParallelContext,
             device: torch.device) -> dict:
    """One mode's step times (the slowest rank's min / median / max), layout, memory and, in graphs, what the
    graph hook did; an error (the same on every rank: a compile failure, out of memory) is the row's result."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    set_horizon(model, None if mode == "graph" else 0)  # horizon 0: the graph hook (if on) runs the call eager
    out: dict = {}
    with torch.compiler.set_stance("default" if mode == "compiled" else "force_eager"):
        try:
            times = _steps(model, inputs, args.repeats, WARMUP[mode], device)
        except Exception as err:  # noqa: BLE001
            return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        if args.profile:  # every rank profiles the step (its collectives need the peers)
            profiled = profile_step(model, inputs, device)
            if dist.get_rank() == 0:
                out["profile"] = profiled
    out.update(layout=layout_record(ctx, model.config.num_attention_heads),
               step_ms=round(1e3 * _worst(statistics.median(times)), 1),
               step_min_ms=round(1e3 * _worst(min(times)), 1), step_max_ms=round(1e3 * _worst(max(times)), 1))
    if mode == "graph":
        stats = graph_hooks(model)[0].stats
        out["graph"] = {"captures": stats.captures, "replays": stats.replays}
    if device.type == "cuda":
        out["peak_gib"] = round(_worst(torch.cuda.max_memory_allocated()) / GIB, 3)
        out["between_forwards_gib"] = round(_worst(torch.cuda.memory_allocated()) / GIB, 3)
    return out


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
    parser.add_argument("--modes", default="eager,graph", help=f"a comma list of {', '.join(MODES)}")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help=f"a comma list of {', '.join(WEIGHTS)}")
    parser.add_argument("--max-memory", type=float, metavar="GIB",
                        help="the split's memory target per GPU (default: halfway between the planned peaks of whole "
                             "and fully sharded weights)")
    parser.add_argument("--method", default="auto", help="the layout (auto: what generate picks by default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=400, help="skip the workloads left after this long")
    parser.add_argument("--out", default="shard.json")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the tiny stand-ins over gloo")
    parser.add_argument("--profile", action="store_true", help="profile one more step per row (rank 0's streams)")
    args = parser.parse_args()
    for option, given, known in (("--modes", args.modes, MODES), ("--weights", args.weights, WEIGHTS)):
        if not set(given.split(",")) <= set(known):
            parser.error(f"{option} {given}: give a comma list of {', '.join(known)}")
    device = torch.device(args.device)
    ctx = init_parallel(ParallelConfig(method=args.method))  # joins torchrun's job (NCCL on GPUs, gloo on the CPU)
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
            rows += run(spec, args, ctx, device)
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

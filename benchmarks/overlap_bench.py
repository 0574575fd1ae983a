"""The all-to-all hidden or not: the stock Ulysses step against Flux.1's single blocks beside their MLP
(ParallelConfig.overlap_mlp), a real-size step, eager and from a CUDA graph, with the output checked against the
stock path's.

One torchrun job (P = its world size, ulysses 1 x P): per workload the transformer is built once (bf16, random
weights), then for each graph mode and each variant ("stock": no overlap; "mlp": the single blocks' MLP beside
the exchanges, "mlp@C" with C SMs left to them; any of them with "+pull": over the symm-pull transport, its all-to-alls one kernel of peer loads) it is
parallelized and its steps timed (the slowest rank's median of --repeats; CUDA events, one synchronize per step). Per
row also the relative error of the step's output against the stock path's, the same mode. --profile adds one profiled
step per row (rank 0's): each CUDA stream's busy time beside the wall (shard_bench.profile_step): with the exchanges
hidden, the compute stream's busy time comes closer to the wall, and the NCCL stream's time overlaps it. --trace DIR
also writes each profiled step as a Chrome trace (Perfetto). One JSON line per row on stdout, all rows in --out.

    torchrun --nproc-per-node 4 benchmarks/overlap_bench.py --workloads flux-dev:1024 --profile
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from shard_bench import _tiny, _worst, profile_step

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.context import shutdown
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize, unparallelize
from streamfusion_diffusers.models.build import build_transformer

TINY = {"flux-dev": "tiny-flux", "qwen-image": "tiny-qwen-image"}


def _step_ms(model: torch.nn.Module, inputs: dict, repeats: int, warmup: int, device: torch.device) -> float:
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(**inputs)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            model(**inputs)
            ms = 1e3 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(ms)
    return _worst(statistics.median(times))


def _config(variant: str) -> ParallelConfig:
    """A variant's config; "+pull" at its end: over the symm-pull transport (its all-to-alls one kernel of peer
    loads from symmetric memory)."""
    variant, pull = variant.removesuffix("+pull"), variant.endswith("+pull")
    transport = {"backend": "symm-pull", "strict": True} if pull else {}
    if variant.startswith("mlp@"):  # mlp@C: the MLP overlap with its GEMMs leaving C SMs to the exchanges (mlp: the default)
        return ParallelConfig(method="ulysses", exchange_sms=int(variant[4:]), **transport)
    if variant in ("stock", "mlp"):
        return ParallelConfig(method="ulysses", overlap_mlp=variant == "mlp", **transport)
    raise SystemExit(f"variant {variant!r} is not stock, mlp or mlp@C (C: the SMs left to the exchanges)")


def run(spec: str, variants: list[str], graph_modes: list[bool], repeats: int, device: torch.device,
        profiled: bool, trace: str | None, cache: GroupCache) -> list[dict]:
    workload = parse_workload(spec)
    name = workload.model if device.type == "cuda" else TINY[workload.model]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_transformer(name, dtype=dtype, device=device)
    inputs = model_inputs(workload if device.type == "cuda" else _tiny(workload, name), dict(model.config), 1, dtype,
                          device)
    rows = []
    for graph in graph_modes:
        plain = None
        for variant in ["stock"] + [v for v in variants if v != "stock"]:
            config = _config(variant)
            ctx = init_parallel(config, groups=cache)
            row = {"workload": workload.name, "ranks": dist.get_world_size(), "cuda_graph": graph,
                   "variant": variant, "overlap_mlp": config.overlap_mlp}
            with torch.no_grad():
                parallelize(model, ctx, cuda_graph=graph)
                out = model(**inputs)[0].clone()
                row["step_ms"] = round(_step_ms(model, inputs, repeats, 2, device), 2)
                if profiled:  # every rank profiles the step (its collectives need the peers)
                    prof = profile_step(model, inputs, device)
                    if dist.get_rank() == 0:
                        row["profile"] = prof
                if trace and dist.get_rank() == 0:
                    _trace(model, inputs, f"{trace}/{workload.model}-graph{int(graph)}-{variant}.json")
                elif trace:
                    model(**inputs)  # the peers' half of rank 0's traced step
                unparallelize(model)
            plain = out if plain is None else plain
            row["rel_err_vs_plain"] = relative_error(out, plain)
            rows.append(row)
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
    return rows


def _trace(model: torch.nn.Module, inputs: dict, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(**inputs)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="*", default=["flux-dev:1024"],
                        help="Flux.1 workloads: only its single blocks run beside their MLP")
    parser.add_argument("--variants", default="stock,mlp",
                        help="stock (no overlap), mlp (single blocks beside their MLP), mlp@C (C SMs left to the "
                             "exchanges); +pull after any: over the symm-pull transport")
    parser.add_argument("--graph", default="eager,graph", help="eager, graph or both")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="profile one more step per row (rank 0's streams)")
    parser.add_argument("--trace", default=None, help="folder for one Chrome trace per row (rank 0's step)")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the tiny stand-ins over gloo, eager")
    parser.add_argument("--out", default="overlap.json")
    args = parser.parse_args()
    cache = GroupCache()
    ctx = init_parallel(ParallelConfig(method="ulysses"), groups=cache)  # joins torchrun's job
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    variants = args.variants.split(",")
    modes = [m == "graph" for m in args.graph.split(",")]
    rows = []
    for spec in args.workloads:
        rows += run(spec, variants, modes, args.repeats, device, args.profile, args.trace, cache)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    shutdown(ctx)


if __name__ == "__main__":
    main()

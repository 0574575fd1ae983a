"""One denoising step of each new model on one machine of P GPUs: ours beside diffusers' context parallelism and
Cache-DiT's, eager and compiled, with peak memory per GPU and each output's error against the unparallelized model.

Real-size transformers with random weights and random prompt embeddings (as benchmarks/models_gpu.py, issue 23:
the models' text encoders are not run). Every case gets a fresh transformer (diffusers' and Cache-DiT's changes
cannot be undone; compiled blocks neither): ours at method "auto" and at each --layouts layout (`parallelize`),
diffusers-cp (`enable_parallelism`, cuDNN attention for its ring's LSE), cache-dit (`cache_dit.enable_cache` with
parallelism only, caching off), cache-dit-fp8 (its FP8 all-to-all: lossy) and cache-dit-async where it has one;
compiled = `compile_repeated_blocks(fullgraph=True)`, as diffusers users compile; ours also replayed from CUDA graphs
(`graph`, what `generate` and `serve` run by default on GPUs, and `compile-graph`: compiled blocks under the graph;
the baselines have no graph path of their own and run eager and compiled only). One line per case on rank 0 and
every row in --out (JSON); a case that cannot run says why in its row. --cpu: a dry run of ours on gloo (tiny
models). Needs the models of issue 23 (streamfusion_diffusers.models.TRANSFORMERS and models.inputs). Under
torchrun, e.g. on 1 x 2:

    torchrun --nproc-per-node 2 benchmarks/models_multigpu.py --models wan2.2-ti2v-5b,qwen-image,flux2-dev:1024 \
        --out $OUT/models-1x2.json
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize
from streamfusion_diffusers.bench import cachedit
from streamfusion_diffusers.models import TRANSFORMERS
from streamfusion_diffusers.models.inputs import build, inputs

SYSTEMS = ("ours", "diffusers-cp", *cachedit.SYSTEMS)
PIXELS_PER_TOKEN = {"flux2": 16, "qwen-image": 16}  # VAE x 2 x 2 packing, each side


def _spec(item: str) -> tuple[str, tuple[int, ...]]:
    """'flux2-dev:2048' -> (name, its token grid at 2048 x 2048); a bare name keeps the model's default grid."""
    name, _, size = item.partition(":")
    spec = TRANSFORMERS[name]
    if not size:
        return name, spec.grid
    side = PIXELS_PER_TOKEN[spec.family]
    return name, (int(size) // side, int(size) // side)


def _degrees(world: int, heads: int) -> list[tuple[int, int]]:
    return [(u, world // u) for u in range(world, 0, -1) if world % u == 0 and heads % u == 0]


def _cases(systems: list[str], layouts: list[str], world: int, heads: int, family: str) -> list[tuple]:
    """(system, ulysses, ring) per case: ours at auto (0, 0) and each layout, the baselines at every degree."""
    cases = []
    for system in systems:
        if system == "ours":
            cases += [(system, 0, 0)] + [(system, int(lay[1:lay.index("R")]), int(lay[lay.index("R") + 1:]))
                                         for lay in layouts]
        else:
            cases += [(system, u, r) for u, r in _degrees(world, heads)
                      if system == "diffusers-cp" or cachedit.why_not(system, u, r, family) is None]
    return cases


def _variants(system: str, variants: list[str]) -> list[str]:
    """The variants a system runs: CUDA graphs are ours only."""
    return variants if system == "ours" else [v for v in variants if v in ("eager", "compile")]


def _install(model: torch.nn.Module, system: str, u: int, r: int, graph: bool = False) -> str:
    """Parallelize a fresh transformer the case's way (ours replayed from CUDA graphs with `graph`); returns its
    layout as said in the row."""
    if system == "ours":
        config = ParallelConfig(method="auto") if u == 0 else ParallelConfig(method="usp", ulysses=u)
        ctx = init_parallel(config)
        parallelize(model, ctx, cuda_graph=graph)
        return "auto" if u == 0 else f"U{u}R{r}"
    if system == "diffusers-cp":
        from diffusers import ContextParallelConfig

        if r > 1:
            model.set_attention_backend("_native_cudnn")  # native SDPA returns no LSE for the ring
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=u, ring_degree=r))
        return f"U{u}R{r}"
    import cache_dit

    cache_dit.enable_cache(model, cache_config=None,
                           parallelism_config=cache_dit.ParallelismConfig(**cachedit.parallelism_options(system, u, r)))
    return cachedit.layout(system, u, r, vae=False)


def _free(gpu: bool) -> None:
    """Free what the last model held: a parallelized model and its hooks reference each other (freed by the
    collector, not by dropping the name), then the allocator's cache; peaks count from here."""
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(model: torch.nn.Module, args: dict, repeats: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
    times, out = [], None
    with torch.no_grad():
        for _ in range(repeats + 2):  # two warm-ups: kernel choices, compilation, allocator
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            out = model(**args, return_dict=False)[0]
            _sync(device)
            times.append(time.perf_counter() - start)
    return times[2:], out


def run_model(item: str, systems: list[str], layouts: list[str], variants: list[str], repeats: int,
              device: torch.device) -> list[dict]:
    name, grid = _spec(item)
    spec, world = TRANSFORMERS[name], dist.get_world_size()
    heads, gpu = spec.transformer["num_attention_heads"], device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    args = inputs(spec.family, spec.transformer, grid, spec.text, dtype=dtype, device=device)
    model = build(spec.family, spec.transformer, dtype=dtype, device=device)
    ref_times, ref = _time(model, args, 1, device)  # the unparallelized step on every rank: the reference
    model = None
    rows = []
    for system, u, r in _cases(systems, layouts, world, heads, spec.family):
        for variant in _variants(system, variants):
            _free(gpu)  # the reference's or the last case's model: one copy per GPU at a time
            row = dict(model=item, tokens=grid, system=system, variant=variant, world=world)
            try:
                model = build(spec.family, spec.transformer, dtype=dtype, device=device)
                row["layout"] = _install(model, system, u, r, graph=variant.endswith("graph"))
                if variant.startswith("compile"):
                    model.compile_repeated_blocks(fullgraph=True)
                times, out = _time(model, args, repeats, device)
                peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0, device=device)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                row.update(step_s=statistics.median(times), min_s=min(times), peak_gib=round(peak.item(), 1),
                           rel_err=err, one_gpu_step_s=ref_times[0])
            except Exception as exc:  # noqa: BLE001 - a case that cannot run says why and the others go on
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                if dist.get_rank() == 0:
                    traceback.print_exc()
            finally:
                model = None
                if variant.startswith("compile"):
                    torch._dynamo.reset()  # its compiled code holds the case's blocks, weights included
            if dist.get_rank() == 0:
                print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="wan2.2-ti2v-5b,qwen-image,flux2-dev:1024,flux2-dev:2048",
                        help="comma-separated TRANSFORMERS names, image models optionally :SIZE (square pixels)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--layouts", default="", help="our layouts besides auto, e.g. U2R1,U1R2 (default: none)")
    parser.add_argument("--variants", default="eager,graph,compile,compile-graph",
                        help="eager, graph (ours: CUDA graphs), compile, compile-graph (ours)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="models_multigpu.json")
    parser.add_argument("--cpu", action="store_true", help="a dry run: gloo, float32, ours only (tiny models)")
    args = parser.parse_args()
    dist.init_process_group("gloo" if args.cpu else "nccl")
    device = torch.device("cpu")
    if not args.cpu:
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    split = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    # the baselines place rank r on GPU r (diffusers' context parallelism, under cache-dit's too)
    systems = [s for s in split(args.systems) if s == "ours" or not args.cpu and (
        s == "diffusers-cp" or cachedit.missing() is None)]
    variants = [v for v in split(args.variants) if not (args.cpu and v.endswith("graph"))]  # graphs need a GPU
    rows = [row for item in split(args.models)
            for row in run_model(item, systems, split(args.layouts), variants, args.repeats, device)]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

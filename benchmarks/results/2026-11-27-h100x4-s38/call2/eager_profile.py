"""Diagnosis: where the eager flux-dev 1024 step at P = 4 goes (not committed)."""
import cProfile, io, json, os, pstats, statistics, sys, time
sys.path.insert(0, "benchmarks")
import torch, torch.distributed as dist
from shard_bench import profile_step
from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.context import shutdown
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize, unparallelize
from streamfusion_diffusers.models.build import build_transformer

OUT = os.environ.get("OUT", ".")
cpu = os.environ.get("DEV") == "cpu"
cache = GroupCache()
ctx0 = init_parallel(ParallelConfig(method="ulysses"), groups=cache)
device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
dtype = torch.float32 if cpu else torch.bfloat16
spec = "flux-dev:64" if cpu else "flux-dev:1024"
w = parse_workload(spec)
name = "tiny-flux" if cpu else "flux-dev"
model = build_transformer(name, dtype=dtype, device=device)
import dataclasses
if cpu: w = dataclasses.replace(w, model="tiny-flux")
inputs = model_inputs(w, dict(model.config), 1, dtype, device)
rank = dist.get_rank()
res = {}
def sync():
    if not cpu: torch.cuda.synchronize()
def steps(n):
    ts = []
    for _ in range(n):
        sync(); t = time.perf_counter(); model(**inputs); sync(); ts.append(1e3 * (time.perf_counter() - t))
    return ts
def host_only(n):
    # host issue time of one step, the GPU synchronized only before
    ts = []
    for _ in range(n):
        sync(); t = time.perf_counter(); model(**inputs); ts.append(1e3 * (time.perf_counter() - t)); sync()
    return ts
for label, cfg in [("default", ParallelConfig()), ("ulysses-stock", ParallelConfig(method="ulysses", overlap_groups=1, overlap_mlp=False))]:
    ctx = init_parallel(cfg, groups=cache)
    with torch.no_grad():
        parallelize(model, ctx, cuda_graph=False)
        steps(3)
        ts = steps(10)
        hs = host_only(5)
        r = {"step_ms": [round(x, 1) for x in ts], "median": round(statistics.median(ts), 1),
             "host_issue_ms": [round(x, 1) for x in hs]}
        prof = profile_step(model, inputs, device)
        r["profile"] = prof
        pr = cProfile.Profile()
        sync(); pr.enable(); model(**inputs); sync(); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
        s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(45)
        if rank == 0:
            with open(f"{OUT}/cprof_{label}.txt", "w") as f:
                f.write(s.getvalue()); f.write(s2.getvalue())
        unparallelize(model)
    res[label] = r
    if rank == 0:
        print(label, json.dumps(r)[:3000], flush=True)
if rank == 0:
    json.dump(res, open(f"{OUT}/eager.json", "w"), indent=1)
shutdown(ctx0)

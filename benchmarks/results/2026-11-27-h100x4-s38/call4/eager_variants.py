"""Diagnosis: the eager flux-dev 1024 step at P = 4 with the watch's throttle and thread changed (not committed)."""
import gc, json, re, os, statistics, sys, time
import torch, torch.distributed as dist
from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.backends import watch
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.context import shutdown
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.diffusers.parallel_pipeline import parallelize, unparallelize
from streamfusion_diffusers.models.build import build_transformer
import dataclasses

OUT = os.environ.get("OUT", ".")
cpu = os.environ.get("DEV") == "cpu"
cache = GroupCache()
ctx0 = init_parallel(ParallelConfig(method="ulysses"), groups=cache)
device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
dtype = torch.float32 if cpu else torch.bfloat16
w = parse_workload("flux-dev:64" if cpu else "flux-dev:1024")
model = build_transformer("tiny-flux" if cpu else "flux-dev", dtype=dtype, device=device)
if cpu: w = dataclasses.replace(w, model="tiny-flux")
inputs = model_inputs(w, dict(model.config), 1, dtype, device)
rank = dist.get_rank()
import subprocess
PIN = os.environ.get("PIN")
if PIN == "numa":
    # the GPU's CPU affinity as nvidia-smi reports it
    line = [l for l in subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout.splitlines() if l.startswith(f"GPU{torch.cuda.current_device()}")][0]
    aff = [c for c in line.split("\t") if re.match(r"^[0-9][0-9,\-]*$", c.strip()) and "-" in c][0].strip()
    cores = set()
    for part in aff.split(","):
        a, b = part.split("-"); cores |= set(range(int(a), int(b) + 1))
    os.sched_setaffinity(0, cores)
elif PIN == "spread":
    n = os.cpu_count() // dist.get_world_size()
    os.sched_setaffinity(0, set(range(rank * n, rank * n + n)))
if PIN: print("rank", rank, "cpus", sorted(os.sched_getaffinity(0))[:3], len(os.sched_getaffinity(0)), flush=True)
def sync():
    if not cpu: torch.cuda.synchronize()
def steps(n):
    ts, hs = [], []
    for _ in range(n):
        sync(); t = time.perf_counter(); model(**inputs); h = time.perf_counter(); sync()
        ts.append(1e3 * (time.perf_counter() - t)); hs.append(1e3 * (h - t))
    return ts, hs
orig_watch, orig_ws = watch.Watchdog.watch, watch.Watchdog.watch_stream
def variant(v):
    watch.RUN_AHEAD = 4
    watch.Watchdog.watch, watch.Watchdog.watch_stream = orig_watch, orig_ws
    gc.enable()
    if "ahead64" in v: watch.RUN_AHEAD = 64
    if "nowatch" in v:
        watch.Watchdog.watch = lambda self, *a, **k: None
        watch.Watchdog.watch_stream = lambda self, *a, **k: None
    if "nogc" in v: gc.disable()
res = {}
cfg = ParallelConfig(method="ulysses", overlap_groups=1)
ctx = init_parallel(cfg, groups=cache)
with torch.no_grad():
    parallelize(model, ctx, cuda_graph=False)
    gc.collect(); gc.freeze()
    for v in os.environ.get("VARIANTS", "base,nowatch").split(","):
        variant(v)
        steps(2)
        ts, hs = steps(8)
        t = torch.tensor([statistics.median(ts)], device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        r = {"median_ms_slowest": round(t.item(), 1), "step_ms": [round(x, 1) for x in ts], "host_ms": [round(x, 1) for x in hs]}
        h = torch.tensor([statistics.median(hs)], device=device, dtype=torch.float64)
        allh = [torch.zeros_like(h) for _ in range(dist.get_world_size())]
        dist.all_gather(allh, h)
        r["host_median_by_rank"] = [round(x.item(), 1) for x in allh]
        res[v + ("" if v not in res else "-again")] = r
        if rank == 0: print(os.environ.get("PIN", "nopin"), v, json.dumps(r), flush=True)
    variant("base")
    unparallelize(model)
if rank == 0:
    json.dump(res, open(f"{OUT}/eager2.json", "w"), indent=1)
shutdown(ctx0)

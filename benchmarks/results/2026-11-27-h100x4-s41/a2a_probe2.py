"""Probe: GEMM SM carveout against an NCCL all-to-all beside it (proj_mlp-size GEMM, Ulysses-size exchange)."""
import os, json, torch, torch.distributed as dist
import torch.nn.functional as F
rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"]); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"]))); dev = torch.device("cuda"); bf = torch.bfloat16
x = torch.randn(1664, 3072, device=dev, dtype=bf); w = torch.randn(12288, 3072, device=dev, dtype=bf); bias = torch.randn(12288, device=dev, dtype=bf)
w2 = torch.randn(3072, 12288, device=dev, dtype=bf); h = torch.randn(1664, 12288, device=dev, dtype=bf)
side = torch.cuda.Stream(); res = {}
def timed(fn, iters=40):
    for _ in range(5): fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): fn()
    e.record(); e.synchronize(); return round(s.elapsed_time(e) / iters * 1000, 1)
gemms = {"mlp_bias": lambda: F.linear(x, w, bias), "mlp_nobias": lambda: F.linear(x, w), "out": lambda: F.linear(h, w2, None)}
n_in, n_out = 3 * 1152 * 3072, 1152 * 3072
bufs = {n: (torch.randn(n, device=dev, dtype=bf), torch.empty(n, device=dev, dtype=bf)) for n in (n_in, n_out)}
for n, (s_, r_) in bufs.items():
    res[f"a2a_{n}"] = timed(lambda: dist.all_to_all_single(r_, s_))
for c in (None, 8, 16, 24, 32, 48):
    torch._C._set_sm_carveout_experimental(c)
    for name, g in gemms.items():
        n = n_in if name.startswith("mlp") else n_out
        s_, r_ = bufs[n]
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side): dist.all_to_all_single(r_, s_)
            g()
            torch.cuda.current_stream().wait_stream(side)
        res[f"{name}@{c}"] = (timed(g), timed(both))
torch._C._set_sm_carveout_experimental(None)
if rank == 0: print(json.dumps(res), flush=True)
dist.destroy_process_group()

"""Probe: does a Ulysses-size all-to-all hide behind a Flux single block's proj_mlp GEMM? NCCL vs copy-engine pulls."""
import os, json, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"]); torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl"); dev = torch.device("cuda"); bf = torch.bfloat16
x = torch.randn(1664, 3072, device=dev, dtype=bf); w = torch.randn(12288, 3072, device=dev, dtype=bf)
res = {}
side = torch.cuda.Stream()
def timed(fn, iters=40):
    for _ in range(5): fn()
    torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters): fn()
    e.record(); e.synchronize(); return round(s.elapsed_time(e) / iters * 1000, 1)
def gemm(): x @ w.t()
def overlapped(comm):
    def f():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side): comm()
        gemm()
        torch.cuda.current_stream().wait_stream(side)
    return f
res["gemm_us"] = timed(gemm)
for rows in (1152, 384):  # QKV of a rank's image rows; the output
    n = 3 * rows * 3072 if rows == 1152 else 1152 * 3072
    send = torch.randn(n, device=dev, dtype=bf); recv = torch.empty_like(send)
    def nccl(): dist.all_to_all_single(recv, send)
    res[f"nccl_{n}"] = timed(nccl); res[f"gemm+nccl_{n}"] = timed(overlapped(nccl))
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(n, dtype=bf, device=dev); hdl = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        buf.copy_(send); chunk = n // world
        peers = [hdl.get_buffer(j, (n,), bf)[rank * chunk:(rank + 1) * chunk] for j in range(world)]
        def ce():
            hdl.barrier(channel=0)
            for j in range(world):
                recv[j * chunk:(j + 1) * chunk].copy_(peers[j])
            hdl.barrier(channel=1)
        res[f"ce_{n}"] = timed(ce); res[f"gemm+ce_{n}"] = timed(overlapped(ce))
        ok = torch.empty_like(send); dist.all_to_all_single(ok, send); ce(); torch.cuda.synchronize()
        res[f"ce_exact_{n}"] = bool(torch.equal(ok, recv))
    except Exception as e:
        res["ce_error"] = repr(e)[:300]
if rank == 0: print(json.dumps(res), flush=True)
dist.destroy_process_group()

"""Device check of the emulated inter-machine link: measured bandwidth within 10% of the preset across
virtual machines, traffic inside a machine untouched.

torchrun --nproc-per-node P benchmarks/emulation_check.py --machines N --link p4de
(P >= 2; with N = P every pair crosses machines, so use N < P to see intra-machine pairs too.)
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.core.links import parse_link


def exchange_ms(ctx, peer: int, nbytes: int, repeats: int) -> float:
    """Median time of one exchange with `peer` (global rank), every rank paired with rank ^ offset."""
    mesh = ctx.mesh(None)
    x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    buf = torch.empty_like(x)
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ctx.transport.exchange([(x, peer)], [(buf, peer)], mesh.world).wait()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--machines", type=int, default=2)
    parser.add_argument("--link", default="p4de")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    m = world // args.machines
    shape = dict(machines=args.machines, gpus_per_machine=m, method="ring")
    emulated = init_parallel(ParallelConfig(emulate_link=args.link, **shape))
    plain = init_parallel(ParallelConfig(**shape))
    link = parse_link(args.link)
    rows = []
    for offset, kind in ((m, "across"), (1, "inside")):
        if offset >= world or (kind == "inside" and m == 1):
            continue
        peer = rank ^ offset
        for mb in (16, 64):
            nbytes = mb * 2**20
            got, real = (exchange_ms(ctx, peer, nbytes, args.repeats) for ctx in (emulated, plain))
            want = link.seconds(nbytes) * 1e3 if kind == "across" else real
            rows.append((kind, mb, got, want, real, abs(got - want) / want <= 0.10))
    if rank == 0:
        print(f"emulated link {link.name}: {world} GPUs as {args.machines} x {m}")
        print(f"{'pair':<7} {'MiB':>4} {'emulated ms':>12} {'expected ms':>12} {'real ms':>8}  within 10%")
        for kind, mb, got, want, real, ok in rows:
            print(f"{kind:<7} {mb:>4} {got:>12.3f} {want:>12.3f} {real:>8.3f}  {'yes' if ok else 'NO'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

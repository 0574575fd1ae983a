"""Probe: Ulysses' all-to-all as peer loads from symmetric memory, against NCCL's (issue 41 item 4).

At flux-dev 1024 on 4 x H100 the graphed step spends 8.6 ms in exchanges and their copies (BENCHMARKS.md, session
43). NCCL moves a single block's packed Q/K/V (21 MB a rank, 3/4 of it to peers) in 81 us, about 200 GB/s of a
link that carries 450: an exchange closer to the link's rate would shorten every one of the step's 114 exchanges,
where hiding them behind GEMMs did not pay. Here each rank's send buffer lies in symmetric memory; after a device
barrier (every rank's data is in place) one Triton kernel (the symm-pull transport's, backends/symm_pull.py) loads
this rank's piece from every peer over NVLink and stores it in the receive buffer; a second barrier (every peer has read mine) frees the send buffer for the next
exchange. The copy into the send buffer is timed apart: a transport would have the projections write there.

    torchrun --nproc-per-node 4 benchmarks/sm_a2a_probe.py [--iters 50]

Prints one line per result as it comes (rank 0) and one JSON line at the end: microseconds per call of NCCL's
all-to-all and of the pull (with and without the copy in), eagerly and replayed from a CUDA graph, at the Q/K/V
and output sizes, and whether the pulled result equals NCCL's.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from ce_a2a_probe import Found, time_us

from streamfusion_diffusers.backends.symm_pull import pull


class PullExchange:
    """An even all-to-all of `n` bf16 elements a rank, pulled by SM loads from the peers' symmetric buffers."""

    def __init__(self, n: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.send = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        self.handle = symm_mem.rendezvous(self.send, dist.group.WORLD.group_name)
        self.ptrs = torch.tensor([self.handle.buffer_ptrs[j] for j in range(self.world)], dtype=torch.int64,
                                 device=device)

    def __call__(self, recv: torch.Tensor, source: torch.Tensor | None = None) -> None:
        if source is not None:
            self.send.copy_(source)
        self.handle.barrier(channel=0)  # every rank's piece is in its buffer
        pull(self.ptrs, recv.view(torch.uint8), self.rank, self.world)
        self.handle.barrier(channel=1)  # every peer has read this rank's buffer: it may be written again


def graphed(fn):
    """fn captured once (after a warm-up) and replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    device = torch.device("cuda")

    def timed(fn) -> float:
        return time_us(fn, args.iters)

    found = Found()
    for name, n in (("qkv", 3 * 1152 * 3072), ("out", 1152 * 3072)):  # flux-dev 1024, P = 4, a rank's share
        send = torch.randn(n, device=device, dtype=torch.bfloat16)
        recv, expected = torch.empty_like(send), torch.empty_like(send)
        dist.all_to_all_single(expected, send)
        calls = {"nccl": lambda: dist.all_to_all_single(recv, send)}
        try:
            pull = PullExchange(n, device)
            pull(recv, send)
            torch.cuda.synchronize()
            found[f"pull_{name}_exact"] = bool(torch.equal(expected, recv))
            calls["pull"] = lambda: pull(recv)
            calls["copy+pull"] = lambda: pull(recv, send)
        except Exception as err:  # noqa: BLE001 - a probe: say what failed and go on
            found[f"pull_{name}_error"] = f"{type(err).__name__}: {err}"[:300]
        for kind, fn in list(calls.items()):
            found[f"{kind}_{name}_us"] = timed(fn)
            try:
                replay = graphed(fn)
                recv.zero_()
                replay()
                torch.cuda.synchronize()
                if kind != "nccl":
                    found[f"{kind}_graph_{name}_exact"] = bool(torch.equal(expected, recv))
                found[f"{kind}_graph_{name}_us"] = timed(replay)
            except Exception as err:  # noqa: BLE001
                found[f"{kind}_graph_{name}_error"] = f"{type(err).__name__}: {err}"[:300]
    if dist.get_rank() == 0:
        print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

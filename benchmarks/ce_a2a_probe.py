"""Probe: an all-to-all that takes no SM, beside a GEMM that takes every SM (issue 41 item 4).

NCCL's all-to-all runs as kernels: beside a cuBLAS GEMM filling every SM it starts only when the GEMM ends, so
the exchange of a Flux single block hides little behind its proj_mlp (BENCHMARKS, session 41). Here each rank
pulls its pieces from its peers' symmetric-memory buffers with the copy engines (`cuMemcpyDtoDAsync` on a side
stream), and the two synchronizations an exchange needs (a peer's data is ready; a peer has read mine) are
stream memory operations on the symmetric signal pads (`cuStreamWriteValue32` into a peer's pad,
`cuStreamWaitValue32` on one's own), which the GPU's front end runs without an SM. If the GEMM and this exchange
together take about the GEMM's time, a transport built this way hides the exchange wherever it has work beside it.

    torchrun --nproc-per-node 4 benchmarks/ce_a2a_probe.py [--iters 40] [--ctas default,8,4] [--carveouts 0,24]

Prints one JSON line (rank 0): microseconds per call of the GEMM alone (leaving C SMs free), each exchange alone
and beside it (NCCL with its own CTA count and capped, copy-engine pulls), whether the pulled pieces equal NCCL's
all-to-all, and the copy-engine timers.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from streamfusion_diffusers.backends.cuda_driver import check, driver


class CopyEngineExchange:
    """An even all-to-all of `n` elements per rank (n / world to each peer) pulled with the copy engines, its
    synchronizations stream memory operations on the symmetric signal pads, with constant values so that a CUDA
    graph replays them: slot j of a rank's pad is raised by peer j when its data is ready and lowered by the rank
    once it saw it; slot world + j is raised by peer j when it finished reading this rank's buffer and lowered by
    the rank before it may write the buffer again."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.drv = driver()
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.send = symm_mem.empty(n, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.send, dist.group.WORLD.group_name)
        self.chunk_bytes = n // self.world * self.send.element_size()
        self.buffers = [self.handle.buffer_ptrs[j] for j in range(self.world)]
        self.pads = [self.handle.signal_pad_ptrs[j] for j in range(self.world)]
        self.pull_streams = [torch.cuda.Stream(device) for _ in range(self.world)]
        self.side = torch.cuda.Stream(device)
        self.handle.get_signal_pad(self.rank, (2 * self.world,), dtype=torch.int32).zero_()
        torch.cuda.synchronize(device)
        dist.barrier()

    def _write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        check(self.drv.cuStreamWriteValue32(self.drv.CUstream(stream.cuda_stream), self.drv.CUdeviceptr(address),
                                            value, 0))

    def _wait(self, stream: torch.cuda.Stream, address: int) -> None:
        """Wait until the slot is raised, then lower it (the next raise comes only after what follows it)."""
        flags = self.drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        check(self.drv.cuStreamWaitValue32(self.drv.CUstream(stream.cuda_stream), self.drv.CUdeviceptr(address),
                                           1, flags))
        self._write(stream, address, 0)

    def __call__(self, recv: torch.Tensor) -> None:
        """Post one exchange on side streams after the current stream's work; the current stream waits for it."""
        me, world = self.rank, self.world
        current = torch.cuda.current_stream()
        self.side.wait_stream(current)
        for j in range(world):  # my data is ready: raise my slot in every peer's pad
            self._write(self.side, self.pads[j] + 4 * me, 1)
        posted = self.side.record_event()
        for j, stream in enumerate(self.pull_streams):
            stream.wait_event(posted)
            self._wait(stream, self.pads[me] + 4 * j)  # peer j's data is ready
            dst = recv.data_ptr() + j * self.chunk_bytes
            src = self.buffers[j] + me * self.chunk_bytes
            check(self.drv.cuMemcpyDtoDAsync(self.drv.CUdeviceptr(dst), self.drv.CUdeviceptr(src), self.chunk_bytes,
                                             self.drv.CUstream(stream.cuda_stream)))
            self._write(stream, self.pads[j] + 4 * (world + me), 1)  # finished reading peer j's
            current.wait_stream(stream)
        for j in range(world):  # nobody reads my buffer any more before I may write it again
            self._wait(current, self.pads[me] + 4 * (world + j))


def copy_engine_timers(timed, beside, device: torch.device, found: dict[str, object]) -> None:
    """An emulated link's delay held by a copy engine instead of a host thread: how long a copy of a given size
    takes alone and beside the GEMM (the same beside it: a timer no attention delays and no GIL holds up).
    A host-to-device copy of pinned bytes (PCIe), and a 2D device copy of one-byte rows (the copy engine's row
    rate, in little memory)."""
    drv = driver()
    stream = torch.cuda.Stream(device)
    pinned = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    landing = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    rows = 1 << 20
    narrow = torch.empty(2 * rows, dtype=torch.uint8, device=device)

    def h2d() -> None:
        with torch.cuda.stream(stream):
            landing.copy_(pinned, non_blocking=True)
        torch.cuda.current_stream().wait_stream(stream)

    def rows_2d() -> None:  # rows of 1 byte at a pitch of 2: no 1D copy can stand in for it
        params = drv.CUDA_MEMCPY2D()
        params.srcMemoryType = params.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        params.srcDevice = drv.CUdeviceptr(narrow.data_ptr())
        params.dstDevice = drv.CUdeviceptr(narrow.data_ptr() + 1)
        params.srcPitch = params.dstPitch = 2
        params.WidthInBytes, params.Height = 1, rows
        check(drv.cuMemcpy2DAsync(params, drv.CUstream(stream.cuda_stream)))
        torch.cuda.current_stream().wait_stream(stream)

    for name, fn in (("h2d_64MiB", h2d), ("rows_2d_1M", rows_2d)):
        try:
            found[f"{name}_us"] = timed(fn)
            found[f"gemm+{name}_us"] = timed(beside(fn))
        except Exception as err:  # noqa: BLE001 - a probe: say what failed and go on
            found[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]


class Found(dict):
    """The results, each also printed by rank 0 as it comes (a later failure or a hang keeps what came before)."""

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, value)
        if dist.get_rank() == 0:
            print(f"{key}: {value}", flush=True)


def time_us(fn, iters: int) -> float:
    """Microseconds per call of `fn`, `iters` calls in a row after a warm-up, every rank started together."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / iters * 1000, 1)


def nccl_group(max_ctas: int | None) -> dist.ProcessGroup:
    """A group over every rank whose NCCL communicator runs its collectives on at most `max_ctas` CTAs."""
    if max_ctas is None:
        return dist.group.WORLD
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = max_ctas
    return dist.new_group(backend="nccl", pg_options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--ctas", default="default,8,4", help="NCCL CTA caps to try (default: NCCL's own)")
    parser.add_argument("--carveouts", default="0,24", help="SMs the GEMM leaves free (torch's cuBLASLt carveout)")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    device, bf = torch.device("cuda"), torch.bfloat16
    x = torch.randn(1664, 3072, device=device, dtype=bf)  # a flux-dev 1024 rank's rows at P = 4, proj_mlp
    w = torch.randn(12288, 3072, device=device, dtype=bf)
    bias = torch.randn(12288, device=device, dtype=bf)  # with a bias: cuBLASLt, which honours the carveout
    side = torch.cuda.Stream()
    carveout = [0]

    def timed(fn) -> float:
        return time_us(fn, args.iters)

    def gemm() -> None:
        torch._C._set_sm_carveout_experimental(carveout[0] or None)
        torch.nn.functional.linear(x, w, bias)
        torch._C._set_sm_carveout_experimental(None)

    def beside(comm):
        def both() -> None:  # the exchange posted first, on its own streams, then the GEMM
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                comm()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return both

    found = Found()
    carveouts = [int(c) for c in args.carveouts.split(",")]
    for c in carveouts:
        carveout[0] = c
        found[f"gemm@{c}_us"] = timed(gemm)
    groups = {name: nccl_group(None if name == "default" else int(name)) for name in args.ctas.split(",")}
    for name, n in (("qkv", 3 * 1152 * 3072), ("out", 1152 * 3072)):
        send = torch.randn(n, device=device, dtype=bf)
        recv = torch.empty_like(send)
        exchanges = {f"nccl[{ctas}]": (lambda g=g: dist.all_to_all_single(recv, send, group=g))
                     for ctas, g in groups.items()}
        try:
            ce = CopyEngineExchange(n, bf, device)
            ce.send.copy_(send)
            pulled = torch.empty_like(send)
            exchanges["ce"] = lambda: ce(pulled)
            expected = torch.empty_like(send)
            dist.all_to_all_single(expected, send)
            ce(pulled)
            torch.cuda.synchronize()
            found[f"ce_{name}_exact"] = bool(torch.equal(expected, pulled))
        except Exception as err:  # noqa: BLE001 - a probe: say what failed and go on
            found[f"ce_{name}_error"] = f"{type(err).__name__}: {err}"[:300]
        if "ce" in exchanges:
            try:  # the same exchange captured once and replayed: what a graphed step would run
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    ce(pulled)
                pulled.zero_()
                graph.replay()
                torch.cuda.synchronize()
                found[f"ce_graph_{name}_exact"] = bool(torch.equal(expected, pulled))
                exchanges["ce_graph"] = graph.replay
            except Exception as err:  # noqa: BLE001
                found[f"ce_graph_{name}_error"] = f"{type(err).__name__}: {err}"[:300]
        for kind, exchange in exchanges.items():
            found[f"{kind}_{name}_us"] = timed(exchange)
            for c in carveouts:
                carveout[0] = c
                found[f"gemm@{c}+{kind}_{name}_us"] = timed(beside(exchange))
    carveout[0] = 0
    copy_engine_timers(timed, beside, device, found)
    if dist.get_rank() == 0:
        print(json.dumps(found), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

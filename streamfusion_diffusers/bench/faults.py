"""Fault injection: one rank is killed (SIGKILL) or stalls (sleeps) in the middle of a run of attention layers;
every other rank must end with an error that names the layer, stage and peer within timeout_s + 10 s.

`fault_rank` is one rank's part, the same on gloo, NCCL and NVSHMEM. `run_local_faults` runs CPU jobs of gloo
processes and collects what each survivor raised (the CI tests); benchmarks/fault_matrix.py runs the GPU jobs
under torchrun and reads the survivors' logs, since there a survivor may be ended by the transport's watchdog.
"""
from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import ParallelConfig, init_parallel, sp_attention

WARMUP = 3  # layers every rank runs before the fault: process groups built, shapes agreed, kernels chosen
SLACK_S = 10.0  # the bar: every survivor ends within timeout_s + this after the fault


@dataclass(frozen=True)
class Fault:
    """Which method runs, how the victim fails (kind "kill" or "stall") and when, and the attention shape."""

    method: str
    kind: str
    timeout_s: float = 5.0
    backend: str = "torch"
    victim: int = 1
    at_layer: int = 3
    layers: int = 1000
    tokens: int = 64
    joint: int = 8
    heads: int = 4
    head_dim: int = 16
    kernel: str = "auto"

    def config(self, world: int) -> ParallelConfig:
        """ulysses over every rank; usp with a ring pass (U = P/2, R = 2); torus across 2 machines (T = 2, with
        a ring inside a machine when there are 4 ranks or more)."""
        base = ParallelConfig(method=self.method, backend=self.backend, timeout_s=self.timeout_s, strict=True,
                              kernel=self.kernel)
        if self.method == "ulysses":
            return replace(base, machines=1)
        if self.method == "usp":
            return replace(base, machines=1, ulysses=max(1, world // 2), ring=min(2, world))
        if self.method == "torus":
            return replace(base, machines=2, ulysses=2, ring=max(1, world // 2))
        raise ValueError(f"fault injection covers ulysses, usp and torus, not {self.method!r}")


def fault_time(out_dir: Path) -> float | None:
    """When the victim failed (wall clock; every rank of a one-host job shares the clock), if it did."""
    path = Path(out_dir) / "fault_time"
    return float(path.read_text()) if path.exists() else None


def fault_rank(fault: Fault, out_dir: Path) -> str:
    """Run `fault.layers` attention layers on this rank; the victim fails at `fault.at_layer`. Returns
    "completed" (nobody failed) or raises whatever the transport raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, fault.tokens // world, fault.heads, fault.head_dim, generator=g).to(device, dtype)
               for _ in range(3))
    jq, jk, jv = (torch.randn(1, fault.joint, fault.heads, fault.head_dim, generator=torch.Generator().manual_seed(0))
                  .to(device, dtype) for _ in range(3))
    dist.barrier()  # every rank is up before groups with a short timeout are created
    ctx = init_parallel(fault.config(world))
    for layer in range(fault.layers + WARMUP):
        if rank == fault.victim and layer == WARMUP + fault.at_layer:
            if gpu:
                torch.cuda.synchronize()
            (Path(out_dir) / "fault_time").write_text(repr(time.time()))
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(4 * fault.timeout_s + 2 * SLACK_S)  # outlasts every survivor's wait
        sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)
        if layer == WARMUP - 1 and gpu:
            torch.cuda.synchronize()
    if gpu:
        torch.cuda.synchronize()
    return "completed"


@dataclass(frozen=True)
class Outcome:
    """What one surviving rank did: "error" (with its message) or "completed", and when, after the fault."""

    rank: int
    status: str
    message: str
    after_fault_s: float | None


def _local_rank(rank: int, world: int, port: int, fault: Fault, out_dir: str, reports: mp.Queue) -> None:
    from ..runtime.pool import _init

    _init(rank, world, port, "gloo", 300.0)  # start-up on a loaded machine may take longer than timeout_s
    try:
        status, message = "completed", fault_rank(fault, Path(out_dir))
    except Exception as err:  # noqa: BLE001 - the survivor reports whatever ended it
        status, message = "error", f"{type(err).__name__}: {err}"
    when = fault_time(Path(out_dir))
    reports.put(Outcome(rank, status, message, None if when is None else time.time() - when))
    reports.close()
    reports.join_thread()
    os._exit(0)  # leave at once, as a failed rank of a real job does, so its peers see it gone


def run_local_faults(faults: list[Fault], world: int, out_dir: Path, startup_s: float = 300.0) -> list[list[Outcome]]:
    """CPU jobs of `world` gloo processes, one per fault, all at once (they mostly wait); each job's survivors'
    outcomes, by rank (the victim is killed at the end if it still sleeps)."""
    from ..runtime.pool import free_port

    ctx = mp.get_context("spawn")
    jobs = []
    for i, fault in enumerate(faults):
        where, reports, port = Path(out_dir) / f"job{i}", ctx.Queue(), free_port()
        where.mkdir(parents=True, exist_ok=True)
        procs = [ctx.Process(target=_local_rank, args=(r, world, port, fault, str(where), reports), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        jobs.append((fault, reports, procs, []))
    deadline = time.monotonic() + startup_s + max(f.timeout_s for f in faults) + 2 * SLACK_S
    try:
        while time.monotonic() < deadline and any(len(found) < world - 1 for _, _, _, found in jobs):
            for _, reports, _, found in jobs:
                while len(found) < world - 1:
                    try:
                        found.append(reports.get(timeout=0.2))
                    except queue.Empty:
                        break
    finally:
        for _, _, procs, _ in jobs:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return [sorted((o for o in found if o.rank != f.victim), key=lambda o: o.rank) for f, _, _, found in jobs]

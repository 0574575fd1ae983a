"""ParallelContext: a resolved layout bound to the running torch.distributed job."""
from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .backends import Transport, make_transport, nvshmem
from .backends.emulated import EmulatedTransport
from .config import Layout, ParallelConfig, machine_shape, resolve_layout
from .links import parse_link
from .mesh import Mesh

logger = logging.getLogger(__name__)


class ParallelContext:
    """Holds the config, the transport and one Mesh per head count (layouts may depend on the heads).

    Meshes are built collectively: either eagerly by `init_parallel` (when the layout does not depend on the
    heads) or at the first `sp_attention` call for a head count, which every rank makes together.

    worlds: when the job runs several sequence-parallel worlds side by side (xDiT's CFG branches), each one's
    global ranks in sequence order; rank and world_size are then this process's place in its own world.
    """

    def __init__(self, config: ParallelConfig, worlds: Sequence[Sequence[int]] | None = None):
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group (or launch "
                                   "with torchrun / `streamfusion launch`) before init_parallel")
            _join_launched_job(config.timeout_s)
        self.config = config
        self.worlds = _check_worlds(worlds) if worlds else None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.worlds:
            own = next(w for w in self.worlds if self.rank in w)
            self.rank, self.world_size = own.index(self.rank), len(own)
        dist_backend = dist.get_backend()
        if config.backend in ("nccl", "gloo") and config.backend != dist_backend:
            raise ValueError(f"backend {config.backend!r} asked for, but the process group runs {dist_backend!r}; "
                             f"use backend='torch' to take whatever the process group runs")
        self.transport: Transport = make_transport(config.backend, strict=config.strict, timeout_s=config.timeout_s)
        if config.emulate_link is not None:
            _, gpus_per_machine = machine_shape(config, self.world_size)
            device = torch.device("cuda", torch.cuda.current_device()) if dist_backend == "nccl" else torch.device("cpu")
            self.transport = EmulatedTransport(self.transport, parse_link(config.emulate_link), gpus_per_machine,
                                               dist.get_rank(), device)
        self._meshes: dict[Layout, Mesh] = {}
        self._by_heads: dict[int | None, Mesh] = {}

    def layout(self, heads: int | None = None) -> Layout:
        """The layout this context runs for a given head count (validates; builds nothing)."""
        return resolve_layout(self.config, self.world_size, heads)

    def mesh(self, heads: int | None = None) -> Mesh:
        """The mesh for this head count, built (collectively) on first use."""
        mesh = self._by_heads.get(heads)
        if mesh is None:
            layout = self.layout(heads)
            mesh = self._meshes.get(layout)
            if mesh is None:
                mesh = self._meshes[layout] = Mesh(layout, self.rank, self.config.timeout_s, self.worlds)
                if self.rank == 0:
                    logger.info("streamfusion: %s on %d ranks", layout, self.world_size)
            self._by_heads[heads] = mesh
        return mesh

    def __repr__(self) -> str:
        return f"ParallelContext({self.config}, rank={self.rank}/{self.world_size})"


def _check_worlds(worlds: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Worlds must split the job into disjoint, equal, ascending rank lists (process groups keep rank order)."""
    out = tuple(tuple(w) for w in worlds)
    flat = sorted(r for w in out for r in w)
    if flat != list(range(dist.get_world_size())) or len({len(w) for w in out}) != 1 \
            or any(list(w) != sorted(w) for w in out):
        raise ValueError(f"worlds {out} must split ranks 0..{dist.get_world_size() - 1} into disjoint groups of "
                         f"one size, each in ascending order")
    return out


def _join_launched_job(timeout_s: float) -> None:
    """Create the default process group of a job that torchrun, `streamfusion launch` or accelerate started
    (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK set): NCCL with one GPU per process, else gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))


def shutdown() -> None:
    """Finalize NVSHMEM (when it was started) and destroy the process group; every rank calls it at the end.

    Both are collective; the barrier first bounds the wait for late ranks by the process group's timeout.
    """
    if dist.is_initialized():
        dist.barrier()
    nvshmem.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def init_parallel(config: ParallelConfig | None = None,
                  worlds: Sequence[Sequence[int]] | None = None) -> ParallelContext:
    """Bind a ParallelConfig to the running job; checks the world size at once. Under a launcher that set
    RANK and WORLD_SIZE it creates the process group too; with backend "nvshmem" it starts NVSHMEM.

    When the layout does not depend on the head count (ulysses or ring given, or method ulysses/ring), the
    process groups are created here; otherwise at the first attention call, by every rank together.
    """
    ctx = ParallelContext(config or ParallelConfig(), worlds)
    config = ctx.config
    fixed = config.ulysses is not None or config.ring is not None or config.method in ("ulysses", "ring")
    machine_shape(config, ctx.world_size)
    if fixed:
        ctx.mesh(None)
    return ctx

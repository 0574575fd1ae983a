"""ParallelContext: a resolved layout bound to the running torch.distributed job."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .backends import EmulatedTransport, Transport, make_transport
from .config import Layout, ParallelConfig, machine_shape, resolve_layout
from .links import parse_link
from .mesh import Mesh

logger = logging.getLogger(__name__)


class ParallelContext:
    """Holds the config, the transport and one Mesh per head count (layouts may depend on the heads).

    Meshes are built collectively: either eagerly by `init_parallel` (when the layout does not depend on the
    heads) or at the first `sp_attention` call for a head count, which every rank makes together.
    """

    def __init__(self, config: ParallelConfig):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group (or launch with "
                               "torchrun / `streamfusion launch`) before init_parallel")
        self.config = config
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        dist_backend = dist.get_backend()
        if config.backend in ("nccl", "gloo") and config.backend != dist_backend:
            raise ValueError(f"backend {config.backend!r} asked for, but the process group runs {dist_backend!r}; "
                             f"use backend='torch' to take whatever the process group runs")
        self.transport: Transport = make_transport(config.backend)
        if config.emulate_link is not None:
            _, gpus_per_machine = machine_shape(config, self.world_size)
            device = torch.device("cuda", torch.cuda.current_device()) if dist_backend == "nccl" else torch.device("cpu")
            self.transport = EmulatedTransport(self.transport, parse_link(config.emulate_link), gpus_per_machine,
                                               self.rank, device)
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
                mesh = self._meshes[layout] = Mesh(layout, self.rank, self.config.timeout_s)
                if self.rank == 0:
                    logger.info("streamfusion: %s on %d ranks", layout, self.world_size)
            self._by_heads[heads] = mesh
        return mesh

    def __repr__(self) -> str:
        return f"ParallelContext({self.config}, rank={self.rank}/{self.world_size})"


def init_parallel(config: ParallelConfig | None = None) -> ParallelContext:
    """Bind a ParallelConfig to the running job; checks the world size at once.

    When the layout does not depend on the head count (ulysses or ring given, or method ulysses/ring), the
    process groups are created here; otherwise at the first attention call, by every rank together.
    """
    ctx = ParallelContext(config or ParallelConfig())
    config = ctx.config
    fixed = config.ulysses is not None or config.ring is not None or config.method in ("ulysses", "ring")
    machine_shape(config, ctx.world_size)
    if fixed:
        ctx.mesh(None)
    return ctx

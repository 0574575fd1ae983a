"""ParallelContext: a resolved layout bound to the running torch.distributed job.

It composes what the floor below provides (the layout and process groups of core/, a transport of backends/,
the kernels' state of kernels/), so it sits above them and below attention/, which runs a layer on it."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from .backends import Transport, make_transport, nvshmem
from .backends.emulated import EmulatedTransport
from .backends.quantized import QuantizedTransport
from .backends.watch import WatchedTransport
from .core.config import Layout, ParallelConfig, cfg_shape, machine_shape, resolve_layout
from .core.join import join_job
from .core.links import parse_link
from .core.logs import forget_said, quiet_other_ranks
from .core.mesh import CfgGroups, Group, GroupCache, Mesh
from .core.transports import transport_spec
from .kernels.state import KernelState

logger = logging.getLogger(__name__)


class Chosen(Protocol):
    """What a layout chooser answers: the layout and the attention kernel for one shape."""

    layout: Layout
    kernel: str


# method="auto"'s layout chooser: (context, q, every rank's slice length, joint length) -> the choice. The layout
# choice (streamfusion_diffusers.choice) provides it and init_parallel hands it over; the core only calls it.
LayoutChooser = Callable[["ParallelContext", torch.Tensor, Sequence[int], int], Chosen]


class ParallelContext:
    """Holds the config, the transport and one Mesh per head count (layouts may depend on the heads).

    Meshes are built collectively: either eagerly by `init_parallel` (when the layout does not depend on the
    heads) or at the first `sp_attention` call for a head count, which every rank makes together.
    With CFG parallelism (config.cfg > 1) `rank` and `world_size` are this rank's place and size in its
    guidance branch's SP group: sequence parallelism sees only its branch. `global_rank` is the job's rank.
    worlds: the SP groups, when the job's caller placed them itself (xDiT's CFG branches and data-parallel
    copies): each one's global ranks in sequence order; the config then describes one of them.
    chooser: what method "auto" asks for a layout, once per attention shape (LayoutChooser).
    groups: the process groups (and meshes) to reuse: another context's `groups`, to share them within a job;
    None: a cache of its own.
    Everything a context keeps (groups, meshes, layout and kernel choices, agreed shapes, tables its CUDA graphs
    replay, the transport's watchdog) lives on it and `shutdown(ctx)` empties it; no module global holds any of
    it (the handle table below holds the context weakly, and shutdown drops it).
    """

    def __init__(self, config: ParallelConfig, worlds: Sequence[Sequence[int]] | None = None,
                 chooser: LayoutChooser | None = None, groups: GroupCache | None = None):
        join_job(timeout_s=config.timeout_s)  # under a launcher, when the script did not join yet
        self.config = config
        self.handle = next(_HANDLES)  # how compiled code names this context (a custom op takes no Python object)
        _LIVE[self.handle] = self
        self.global_rank, self.job_size = dist.get_rank(), dist.get_world_size()
        self.worlds = _check_worlds(worlds) if worlds else None
        self.machines, self.gpus_per_machine = machine_shape(config, len(self.worlds[0]) if self.worlds
                                                             else self.job_size)
        dist_backend = dist.get_backend()
        spec = transport_spec(config.backend)
        if config.backend in spec.process_groups and config.backend != dist_backend:  # an alias that pins it
            raise ValueError(f"backend {config.backend!r} asked for, but the process group runs {dist_backend!r}; "
                             f"use backend={spec.name!r} to take whatever the process group runs")
        self.transport: Transport = make_transport(config.backend, strict=config.strict, timeout_s=config.timeout_s)
        if config.emulate_link is not None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist_backend == "nccl" else torch.device("cpu")
            self.transport = EmulatedTransport(self.transport, parse_link(config.emulate_link),
                                               self.gpus_per_machine, self.global_rank, device)
        if config.comm_dtype is not None:
            if not transport_spec(self.transport.kind).comm_dtype:
                raise ValueError(f"comm_dtype={config.comm_dtype!r} runs over a two-sided transport, not "
                                 f"{self.transport.kind}; use backend='torch' with it, or comm_dtype=None")
            self.transport = QuantizedTransport(self.transport, config.comm_dtype, self.gpus_per_machine,
                                                self.global_rank)
        self.transport = WatchedTransport(self.transport, config.timeout_s)  # named, bounded waits (outermost)
        self.kernels = KernelState()  # the attention kernels' choices and captured tables (kernels/state.py)
        self.groups = groups if groups is not None else GroupCache()
        self._meshes: dict[Layout, Mesh] = {}
        self._by_heads: dict[int | None, Mesh] = {}
        self.chooser = chooser
        self.chosen: dict[tuple, Chosen] = {}  # method "auto": the chooser's answer per attention shape
        self.agreed: set[tuple] = set()  # sp_attention shapes every rank has agreed on (attention/agreement.py)
        self.plans: dict[tuple, object] = {}  # per sp_attention shape, what the call runs (attention/layer.py)
        self._on_close: list[Callable[[], None]] = []
        self.native_now = False  # a quantized kernel's native step: the inputs' precision (attention_step)
        self.fault = None  # verify --self-test only: a deliberate fault for the schedules (attention/faults.py)
        self._cfg: CfgGroups | None = None
        if self.worlds:
            if config.cfg != 1:
                raise ValueError("with worlds given, the caller splits the guidance batch: leave cfg=1")
            self._cfg = CfgGroups.of_branches(self.worlds, self.global_rank, config.timeout_s, self.groups)
        elif config.cfg != "auto":
            self.resolve_cfg()

    def resolve_cfg(self, batch: int | None = None) -> int:
        """The CFG degree, fixed at the first call (collective: it creates the branch groups). cfg="auto" takes 2
        when `batch` (the guidance batch the transformer sees) is 2 and the job splits into two branches, else 1."""
        if self._cfg is None:
            degree = self.config.cfg
            if degree == "auto":
                degree = 2 if batch == 2 and self._cfg_fits(2) else 1
                if self.global_rank == 0:
                    logger.info("streamfusion: cfg='auto' chose cfg=%d (batch %s)", degree, batch)
            self._cfg = CfgGroups.build(self.machines, self.gpus_per_machine, degree, self.global_rank,
                                        self.config.timeout_s, self.groups)
        return self._cfg.degree

    def _cfg_fits(self, degree: int) -> bool:
        try:
            n, m = cfg_shape(self.machines, self.gpus_per_machine, degree)
            if self.config.ulysses is not None or self.config.ring is not None:
                resolve_layout(self._branch_config(n, m), n * m, None)
        except ValueError:
            return False
        return True

    def _branch_config(self, machines: int, gpus_per_machine: int) -> ParallelConfig:
        return dataclasses.replace(self.config, machines=machines, gpus_per_machine=gpus_per_machine, cfg=1)

    @property
    def cfg(self) -> CfgGroups:
        """The CFG dimension: the branches, this rank's SP group and its CFG group (resolves cfg='auto' to 1 if
        nothing resolved it yet)."""
        self.resolve_cfg()
        return self._cfg

    @property
    def rank(self) -> int:
        return self.cfg.sp.index

    @property
    def world_size(self) -> int:
        return self.cfg.sp.size

    @property
    def pipeline_group(self) -> Group:
        """The ranks that run one pipeline together and so hold the same latents: the whole job (both guidance
        branches too), or with `worlds` given, this rank's world only (another world runs its own prompt). What
        work outside the transformer, such as the VAE decode, is shared over. Collective on first use."""
        if self.worlds:
            return self.cfg.sp
        pg = self.groups.world(self.config.timeout_s) if self.job_size > 1 else None
        return Group(tuple(range(self.job_size)), self.global_rank, pg, "job")

    @property
    def branch_shape(self) -> tuple[int, int]:
        """(machines, GPUs per machine) of one guidance branch: the cluster sequence parallelism sees."""
        if self.worlds:
            return self.machines, self.gpus_per_machine
        return cfg_shape(self.machines, self.gpus_per_machine, self.cfg.degree)

    def layout(self, heads: int | None = None) -> Layout:
        """The SP layout this context runs for a given head count (validates; builds nothing): with CFG
        parallelism, that of one branch (cfg_shape: half of the machines, or half of every machine). With method
        "auto", the last one chosen for that head count (it is chosen at the first sp_attention call)."""
        if self.config.method == "auto":
            found = [c.layout for key, c in self.chosen.items() if key[1] == heads]
            if not found:
                raise ValueError(f"method 'auto' has not chosen a layout for {heads} heads yet: it does so at the "
                                 f"first sp_attention call")
            return found[-1]
        n, m = self.branch_shape
        return resolve_layout(self._branch_config(n, m), self.world_size, heads)

    def mesh_of(self, layout: Layout) -> Mesh:
        """The mesh of a resolved layout, built (collectively) on first use."""
        mesh = self._meshes.get(layout)
        if mesh is None:
            mesh = self._meshes[layout] = self.groups.mesh(layout, self.global_rank, self.config.timeout_s, self.cfg)
            if self.global_rank == 0:
                cfg = f", cfg={self.cfg.degree}" if self.cfg.degree > 1 else ""
                logger.info("streamfusion: %s on %d ranks%s", layout, self.job_size, cfg)
        return mesh

    def attention_plan(self, q: torch.Tensor, seq_lens: Sequence[int], joint_len: int) -> tuple[Mesh, str]:
        """(mesh, kernel) for one sp_attention call: the config's own, or for method "auto" the chooser's answer
        for this shape, asked once per shape (collectively: every rank makes the same call)."""
        if self.config.method != "auto":
            return self.mesh(q.shape[2]), self.config.kernel
        b, _, heads, head_dim = q.shape
        key = (sum(seq_lens), heads, head_dim, joint_len, q.dtype, b)
        choice = self.chosen.get(key)
        if choice is None:
            if self.chooser is None:
                raise ValueError("method 'auto' needs a layout chooser: create the context with "
                                 "streamfusion_diffusers.init_parallel, or pass a method")
            choice = self.chosen[key] = self.chooser(self, q, seq_lens, joint_len)
        return self.mesh_of(choice.layout), choice.kernel

    def attention_step(self, step: int, steps: int) -> None:
        """Say which step of `steps` the coming transformer calls make (0-based): with a quantized kernel ("int8",
        "fp8"), the first and last `native_steps` attend in the inputs' precision. A pipeline's step callback
        calls it (the runtime's does); without calls every step runs the asked-for kernel."""
        first, last = self.config.native_steps
        self.native_now = step < first or step >= steps - last

    def kernel_now(self, kernel: str) -> str:
        """The kernel this step runs for a planned call: a quantized one gives way to the per-call choice on a
        native step."""
        return "auto" if self.native_now and kernel in ("int8", "fp8") else kernel

    def mesh(self, heads: int | None = None) -> Mesh:
        """The mesh for this head count, built (collectively) on first use."""
        mesh = self._by_heads.get(heads)
        if mesh is None:
            mesh = self._by_heads[heads] = self.mesh_of(self.layout(heads))
        return mesh

    def close(self) -> None:
        """Forget what this context keeps: meshes, process groups (shared ones too), layout and kernel choices,
        agreed shapes, captured tables, what asked to be released (on_close); stop the transport's watchdog;
        compiled code can no longer reach it."""
        self.groups.clear()
        self._meshes.clear()
        self._by_heads.clear()
        self.chosen.clear()
        self.agreed.clear()
        self.plans.clear()
        self.kernels.clear()
        while self._on_close:
            self._on_close.pop()()
        self.transport.close()
        _LIVE.pop(self.handle, None)

    def on_close(self, release: Callable[[], None]) -> None:
        """Run `release` when the context closes: what holds work on its process groups (CUDA graphs that
        captured NCCL calls) lets go of it before the groups are destroyed."""
        self._on_close.append(release)

    def __repr__(self) -> str:
        return f"ParallelContext({self.config}, rank={self.global_rank}/{self.job_size})"


def _check_worlds(worlds: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Worlds must split the job into disjoint, equal, ascending rank lists (process groups keep rank order)."""
    out = tuple(tuple(w) for w in worlds)
    flat = sorted(r for w in out for r in w)
    if flat != list(range(dist.get_world_size())) or len({len(w) for w in out}) != 1 \
            or any(list(w) != sorted(w) for w in out):
        raise ValueError(f"worlds {out} must split ranks 0..{dist.get_world_size() - 1} into disjoint groups of "
                         f"one size, each in ascending order")
    return out


# The handle table behind the custom op (attention/op.py), module-level because compiled code names a context by
# an int: handles never repeat (code compiled for a dead context must not reach a new one), the table holds
# contexts weakly, and close() drops the entry.
_HANDLES = itertools.count()
_LIVE: weakref.WeakValueDictionary[int, ParallelContext] = weakref.WeakValueDictionary()


def context_of(handle: int) -> ParallelContext:
    """The live context with this `handle` (what the compiled `sp_attention` op receives in its place)."""
    ctx = _LIVE.get(handle)
    if ctx is None:
        raise RuntimeError(f"ParallelContext {handle} is gone: compiled code outlived its context; compile again "
                           f"after init_parallel")
    return ctx


def shutdown(ctx: ParallelContext | None = None, destroy: bool = True) -> None:
    """End the job on this rank: close every live context (`ctx` and any other: ctx.close), finalize NVSHMEM
    (when it was started) and destroy the process group; every rank calls it at the end. The job is over: messages
    said once are said again in the next. destroy=False leaves the process group to the process's exit (a rank
    process about to end: runtime/rank.py).

    Both are collective; the barrier first bounds the wait for late ranks by the process group's timeout.
    NVSHMEM is one runtime per process (backends/nvshmem_runtime.py), shared by every context, so it is torn down
    here, with the process group, rather than by one context. A CUDA graph that captured NCCL calls holds them
    until it is freed, and NCCL's communicator teardown waits for that: the contexts free their graphs (on_close),
    and unreachable ones are collected, before the groups are destroyed.
    """
    if dist.is_initialized():
        dist.barrier()
    for live in dict.fromkeys([ctx] * (ctx is not None) + list(_LIVE.values())):
        live.close()
    nvshmem.close()
    forget_said()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if destroy and dist.is_initialized():
        dist.destroy_process_group()


def init_parallel(config: ParallelConfig | None = None, worlds: Sequence[Sequence[int]] | None = None,
                  chooser: LayoutChooser | None = None, groups: GroupCache | None = None) -> ParallelContext:
    """Bind a ParallelConfig to the running job; checks the world size at once. Under a launcher that set
    RANK and WORLD_SIZE it creates the process group too; with backend "nvshmem" it starts NVSHMEM.

    When the layout does not depend on the head count (ulysses or ring given, or method ulysses/ring), the
    process groups are created here; otherwise at the first attention call, by every rank together.
    chooser: method "auto"'s layout chooser (streamfusion_diffusers.init_parallel passes the layout choice's).
    groups: another context's `groups`, whose process groups the new context then reuses.
    """
    ctx = ParallelContext(config or ParallelConfig(), worlds, chooser, groups)
    quiet_other_ranks()  # a job started without a launcher's RANK knows its ranks from here
    config = ctx.config
    fixed = config.ulysses is not None or config.ring is not None or config.method in ("ulysses", "ring")
    if fixed and config.cfg != "auto":
        ctx.mesh(None)
    return ctx

"""Per-shape choice between the fused multi-chunk kernel and SDPA + merge, by measured speed, the same on every rank.

Each candidate is timed on scratch copies of the state after a device synchronize, so that transfers the schedule
still has in flight slow neither candidate; the times are kept per signature (dtype, shapes, chunk lengths,
earlier state, finalize) in the running call's KernelState (state.py: its context's, emptied by shutdown()).

Ranks of one layer run in lockstep, so a rank that picks the slower kernel for a step makes every rank wait: the
ranks must agree. A collective per signature inside `choose` cannot do that: with uneven splits (seq_lens, joint
rows split over ring peers) ranks see different chunk lengths, hence different signatures that hit their caches
at different calls, and a rank whose chunks are empty makes no choice at all, so such a collective would
deadlock. What every rank does alike is the layer call (its signature: layout, every rank's lengths, heads,
dtype) and the order of its `attend_chunks` calls (the schedules are symmetric: R ring steps per stage, T torus
stages, one call per wave). So inside `layer(...)` a choice belongs to a call position: the first call of a new
layer signature times each position locally and runs the local pick; at its end one all_gather of the
[calls x kernels] times over the group gives every rank the same table, and each position takes the kernel
whose slowest rank is fastest. Later calls of that signature look the choice up, with no collective; none runs
while a CUDA graph is captured (the warm-up before it chooses) nor on one rank. `clear()` must run on every rank.

`pin()` (a job's --deterministic) replaces the timing by a fixed rule, the same in every process and every run:
timings differ between processes within noise, and a differing pick differs in the last bits of the pixels.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Hashable
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.logs import say_once
from ..core.mesh import Group
from ..core.one_time import one_time
from .state import KernelState, current, owned_by

logger = logging.getLogger(__name__)

KERNELS = ("sdpa", "fused")  # every choice's candidates, in the order of the agreed table's columns
Candidates = dict[str, tuple[Callable[[], object], Callable[[object], None]]]
PINNED = "fused"  # what a pinned choice takes where it is a candidate (no merge pass after it), else "sdpa"
_pinned = False  # set by pin(): this process's "auto" choices by rule, none timed


class _Layer:
    """The layer call in progress: the agreed kernels by call position (None until agreed), and this call's
    local times by position (None where that call made no choice)."""

    __slots__ = ("agreed", "calls")

    def __init__(self, agreed: list[str | None] | None):
        self.agreed = agreed
        self.calls: list[dict[str, float] | None] = []


# The layer call in progress in this thread (a ContextVar: set and reset around the call by `layer`).
_layer: ContextVar[_Layer | None] = ContextVar("streamfusion_kernel_layer", default=None)


def time_ms(prepare: Callable[[], object], run: Callable[[object], None], reps: int = 3) -> float:
    """Median CUDA-event time of run(prepare()) on an idle GPU after one warm-up; prepare stays outside the timed
    region."""
    torch.cuda.synchronize()  # let the schedule's transfers in flight finish first
    run(prepare())
    times = []
    for _ in range(reps):
        arg = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(arg)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def _measure(key: Hashable, candidates: Callable[[], Candidates]) -> dict[str, float]:
    times = current().times
    if key not in times:
        with one_time("kernel choice"):
            times[key] = {name: time_ms(prepare, run) for name, (prepare, run) in candidates().items()}
    return times[key]


def _fastest(times: dict[str, float]) -> str:
    return min(times, key=times.get)


def pin(on: bool = True) -> None:
    """Make this process's "auto" kernel choices (here and sdpa.py's backend) by a fixed rule, never timed."""
    global _pinned
    _pinned = on


def pinned() -> bool:
    return _pinned


def count_call() -> None:
    """An attend_chunks call began (whether or not it will choose): inside `layer`, the next call position."""
    scope = _layer.get()
    if scope is not None:
        scope.calls.append(None)


def choose(key: Hashable, candidates: Callable[[], Candidates]) -> str:
    """The kernel (a name in KERNELS) to run for this signature: inside `layer`, the one agreed for this call
    position (this rank's fastest until the ranks have agreed); outside, this rank's fastest, cached; pinned,
    PINNED where it is a candidate. candidates: makes the timed runs, called only where a signature is timed (a
    lookup builds nothing)."""
    if _pinned:
        return PINNED if PINNED in candidates() else KERNELS[0]
    scope = _layer.get()
    if scope is None:
        local = current().local
        if key not in local:
            times = _measure(key, candidates)
            local[key] = _fastest(times)
            say_once(logger, logging.INFO, "attention kernel for %s: %s (%s)", key, local[key],
                     ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))
        return local[key]
    position = len(scope.calls) - 1
    if scope.agreed is not None and position < len(scope.agreed) and scope.agreed[position] is not None:
        return scope.agreed[position]
    times = _measure(key, candidates)
    scope.calls[position] = times
    return _fastest(times)


class layer:  # noqa: N801 - a context manager used as a function; a class: it runs at every layer call
    """Scope of one layer call whose choices every rank of `group` shares. signature: what every rank knows
    alike about the call (layout, every rank's lengths, heads, dtype), never this rank's own chunk shapes.
    The agreed table is kept in `owner` (the call's context's KernelState, made the current one inside; None:
    the current one)."""

    __slots__ = ("signature", "group", "owner", "owned", "state", "scope", "token")

    def __init__(self, signature: Hashable, group: Group, owner: KernelState | None = None):
        self.signature, self.group, self.owner = signature, group, owner

    def __enter__(self) -> None:
        self.owned = owned_by(self.owner) if self.owner is not None else None
        if self.owned is not None:
            self.owned.__enter__()
        self.state = self.owner if self.owner is not None else current()
        self.scope = _Layer(self.state.agreed.get((self.group.ranks, self.signature)))
        self.token = _layer.set(self.scope)

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        try:
            if error is None and self.scope.agreed is None and not _capturing():
                self.state.agreed[self.group.ranks, self.signature] = agree(self.scope.calls, self.group,
                                                                            self.signature)
        finally:
            _layer.reset(self.token)
            if self.owned is not None:
                self.owned.__exit__()


def agree(calls: list[dict[str, float] | None], group: Group, signature: Hashable) -> list[str | None]:
    """Per call position, the kernel whose slowest rank is fastest (None where no rank chose), the same on every
    rank of `group`: one all_gather of every rank's times."""
    if not calls:
        return []
    missing = float("-inf")  # a rank that made no choice at a position leaves it to the others
    table = torch.tensor([[c[name] if c else missing for name in KERNELS] for c in calls], dtype=torch.float64)
    everyone = _gather(table, group) if group.size > 1 else table[None]  # [ranks, calls, kernels]
    slowest = everyone.amax(0)
    agreed: list[str | None] = []
    for i, row in enumerate(slowest):
        if torch.isinf(row).all():
            agreed.append(None)
            continue
        agreed.append(KERNELS[int(row.argmin())])
        own = [KERNELS[int(r.argmin())] if torch.isfinite(r).all() else "-" for r in everyone[:, i]]
        say_once(logger, logging.INFO, "attention kernel for call %d of %s: %s on every rank (slowest rank: %s; "
                 "each rank's own pick: %s)", i, signature, agreed[-1],
                 ", ".join(f"{name} {ms:.3f} ms" for name, ms in zip(KERNELS, row.tolist())), ", ".join(own))
    return agreed


def _capturing() -> bool:
    """A CUDA graph is being captured: no collective may run."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gather(table: Tensor, group: Group) -> Tensor:
    """Every rank's table stacked in group order (NCCL gathers on this rank's GPU)."""
    nccl = "nccl" in str(dist.get_backend(group.pg))
    mine = table.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
    everyone = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(everyone, mine, group=group.pg)
    return torch.stack(everyone).cpu()


def clear() -> None:
    """Forget the current KernelState's times and choices (tests, or after the GPU's load changed); on every
    rank alike."""
    current().forget_choices()

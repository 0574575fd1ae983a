"""Per-shape choice between the fused multi-chunk kernel and SDPA + merge, by measured speed, the same on every rank.

Each candidate is timed on scratch copies of the state after a device synchronize, so that transfers the schedule
still has in flight slow neither candidate; the times are kept per signature (dtype, shapes, chunk lengths,
earlier state, finalize) for the process's lifetime.

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
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.logs import say_once
from ..core.mesh import Group

logger = logging.getLogger(__name__)

KERNELS = ("sdpa", "fused")  # every choice's candidates, in the order of the agreed table's columns
Candidates = dict[str, tuple[Callable[[], object], Callable[[object], None]]]

_times: dict[Hashable, dict[str, float]] = {}  # signature -> this rank's measured ms per kernel
_choices: dict[Hashable, str] = {}  # signature -> local choice outside a layer (kernel tests and benchmarks)
_agreed: dict[Hashable, list[str | None]] = {}  # (group ranks, layer signature) -> kernel per call position


@dataclass
class _Layer:
    """The layer call in progress: the agreed kernels by call position (None until agreed), and this call's
    local times by position (None where that call made no choice)."""

    agreed: list[str | None] | None
    calls: list[dict[str, float] | None] = field(default_factory=list)


_layer: _Layer | None = None


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


def _measure(key: Hashable, candidates: Candidates) -> dict[str, float]:
    if key not in _times:
        _times[key] = {name: time_ms(prepare, run) for name, (prepare, run) in candidates.items()}
    return _times[key]


def _fastest(times: dict[str, float]) -> str:
    return min(times, key=times.get)


def count_call() -> None:
    """An attend_chunks call began (whether or not it will choose): inside `layer`, the next call position."""
    if _layer is not None:
        _layer.calls.append(None)


def choose(key: Hashable, candidates: Candidates) -> str:
    """The kernel (a name in KERNELS) to run for this signature: inside `layer`, the one agreed for this call
    position (this rank's fastest until the ranks have agreed); outside, this rank's fastest, cached."""
    if _layer is None:
        if key not in _choices:
            times = _measure(key, candidates)
            _choices[key] = _fastest(times)
            say_once(logger, logging.INFO, "attention kernel for %s: %s (%s)", key, _choices[key],
                     ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))
        return _choices[key]
    position = len(_layer.calls) - 1
    if _layer.agreed is not None and position < len(_layer.agreed) and _layer.agreed[position] is not None:
        return _layer.agreed[position]
    times = _measure(key, candidates)
    _layer.calls[position] = times
    return _fastest(times)


@contextmanager
def layer(signature: Hashable, group: Group) -> Iterator[None]:
    """Scope of one layer call whose choices every rank of `group` shares. signature: what every rank knows
    alike about the call (layout, every rank's lengths, heads, dtype), never this rank's own chunk shapes."""
    global _layer
    key = (group.ranks, signature)
    _layer = _Layer(_agreed.get(key))
    try:
        yield
        if _layer.agreed is None and not _capturing():
            _agreed[key] = agree(_layer.calls, group, signature)
    finally:
        _layer = None


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
    """Forget every time and choice (tests, or after the GPU's load changed); on every rank alike."""
    _times.clear()
    _choices.clear()
    _agreed.clear()

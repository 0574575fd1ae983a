"""The parallel groups: each a pool of rank processes with the pipeline built on them, and its supervision.

`--replicas R` splits the P ranks into R groups of P / R. Each group is its own job (its own process group,
a `ProcessPool`, pool.py) rather than one slice of a shared world (`init_parallel(worlds=...)`):
a rank that dies then takes down only its own group, which is restarted and rebuilt while the others keep
serving, and a group runs exactly what `generate` runs on P / R ranks. The pool sees a rank end within its poll
(0.5 s) and a stalled one at the request's hard deadline, stops the group's other ranks, and raises; the
supervisor (serve/supervisor.py) answers the request with 5xx and calls `start` again. A group of a job across
machines (`hosts`) has its ranks spawned by the launched processes of its slots instead (remote.py): its start
first waits until every one of them is connected, so a group whose node was lost comes back once the node's
launcher has restarted.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from . import startup, worker
from .build import import_ahead
from .job import Job
from .pool import Pool, ProcessPool, RankFailure
from .progress import StepNote
from .record import one_time_text
from .remote import Hosts
from .request import Request

logger = logging.getLogger(__name__)

HARD_GRACE_S = 30.0  # past its deadline, how long a request may still take to stop at a step before its group is
# declared stalled and restarted (a step, then the decode of a large video, fits in it on a GPU)


class BuildTimeout(ValueError):
    """A group's start (ranks, build, warm-up) took longer than it may: a configuration to change."""


class Group:
    """One parallel group: `job.world_size` ranks on `devices` (GPU indices; None on the CPU), warmed up with
    `warm`'s calls (width, height, images) before it is ready."""

    def __init__(self, index: int, job: Job, devices: list[str] | None, warm: tuple[tuple[int, int, int], ...],
                 hosts: Hosts | None = None):
        self.index, self.job, self.devices, self.hosts, self.warm = index, job, devices, hosts, warm
        self.pool: Pool | None = None
        self._stops = 0  # how many times `stop` was called (a start waiting for nodes gives up on the next)
        self.info: dict[str, Any] = {}  # rank 0's answer to `build`: build and warm-up times, the warm-up's record
        self.restarts = 0
        self.restarted_at: list[float] = []  # when each restart began (time.monotonic()), for the rate limit
        self._running: dict[str, Request] = {}  # the batch in flight, by request id
        self._cancelled: set[str] = set()  # its requests cancelled so far
        self._call = 0  # its call number in the pool (what a cancel names)

    def start(self, timeout_s: float = math.inf, say: Callable[[str], None] = lambda _: None,
              waiting: Callable[[bool], None] = lambda _: None) -> dict[str, Any]:
        """Start the ranks, build and warm up the pipeline (blocking: the service runs it in a thread), saying each
        stage done; across machines `waiting(True)` while it waits for a lost node, `waiting(False)` once every
        node is there. Raises BuildTimeout past `timeout_s` in all, RankFailure when a rank fails or `stop` is
        called meanwhile (from another thread: it ends the start at once)."""
        env = {"CUDA_VISIBLE_DEVICES": ",".join(self.devices)} if self.devices else None
        if self.hosts is None:
            pool: Pool = ProcessPool(self.job.world_size, backend="nccl" if self.job.gpu else "gloo",
                                     timeout_s=self.job.parallel.timeout_s, wait_s=math.inf, env=env, wait=False,
                                     ahead=import_ahead if self.job.gpu else None)
        else:
            pool = self._join(say, waiting)
        self.pool = pool
        started = time.monotonic()
        stage = "starting the ranks"
        try:
            pool.wait_started(timeout_s)
            say(f"group {self.index}: {self.job.world_size} rank(s) started in {time.monotonic() - started:.1f} s")
            stage = "building the pipeline"
            self.info = pool.run_within(timeout_s - (time.monotonic() - started), worker.build, self.job)[0]
            say(f"group {self.index}: pipeline built (rank 0's start-up: {startup.describe(self.info['startup_s'])})")
            stage = "warming up"
            self.info.update(pool.run_within(timeout_s - (time.monotonic() - started), worker.warm_up, self.warm)[0])
        except RankFailure as err:
            if time.monotonic() - started >= timeout_s and not err.died:
                raise BuildTimeout(f"group {self.index}: its start took longer than --build-timeout {timeout_s:g} s "
                                   f"(stopped while {stage}): raise --build-timeout") from None
            raise
        say(f"group {self.index}: warm-up done in {self.info['warmup_s']:.1f} s"
            f"{warmup_split(self.info.get('record'), self.job.cuda_graph)}")
        return self.info

    def _join(self, say: Callable[[str], None], waiting: Callable[[bool], None]) -> Pool:
        """The pool of a group across machines, once the hosts of every one of its slots are connected."""
        assert self.hosts is not None
        stops = self._stops
        if missing := self.hosts.missing():
            waiting(True)
            say(f"group {self.index}: waiting for node(s) {', '.join(map(str, self.hosts.nodes(missing)))}")
        pool = self.hosts.pool(self.job.gpu, self.job.parallel.timeout_s, lambda: self._stops != stops)
        if missing:
            waiting(False)
        return pool

    def run(self, batch: list[Request], deadline_s: float,
            on_step: Callable[[StepNote], None] | None = None) -> dict[str, Any]:
        """One batch on every rank as one pipeline call (blocking); `on_step` gets rank 0's note at each step's
        end (in this thread). Raises RankFailure (the pool already stopped) when a rank died, failed, or did not
        stop within HARD_GRACE_S past the deadline."""
        assert self.pool is not None
        self._call, self._cancelled = self.pool.calls + 1, set()
        self._running = {r.id: r for r in batch}
        self.pool.on_note = on_step
        try:
            return self.pool.run_within(deadline_s + HARD_GRACE_S, worker.run, batch, deadline_s)[0]
        finally:
            self._running = {}
            if self.pool is not None:
                self.pool.on_note = None

    def cancel(self, request_id: str) -> bool:
        """Cancel a running request: its batch stops at the next step every rank agrees on once every request of
        it is cancelled; until then the batch runs on (its other requests still want their images) and the
        cancelled one's images are dropped by the caller. False when the request is not running here."""
        if request_id not in self._running or self.pool is None:
            return False
        self._cancelled.add(request_id)
        if self._cancelled >= self._running.keys():
            self.pool.cancel(self._call)
        return True

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, steps) of a running request, from rank 0's notes; None when it is not running here."""
        found = self.pool.last_note if self.pool is not None and request_id in self._running else None
        if found is None or request_id not in found.ids:
            return None
        return found.step, found.steps

    @property
    def pids(self) -> list[int]:
        return self.pool.pids if self.pool is not None else []

    def dead(self) -> dict[int, str]:
        """Ranks of the group that have ended, with why: a group with any is restarted before it runs a request."""
        return self.pool.dead() if self.pool is not None else {}

    def stop(self, now: bool = False) -> None:
        """End the ranks: together (their shutdown is collective), or with `now` at once."""
        self._stops += 1
        if self.pool is not None:
            self.pool.close(stop=now)
            self.pool = None

    def describe(self) -> dict[str, Any]:
        """What /health says of the group."""
        record = self.info.get("record") or {}
        return {"index": self.index, "ranks": self.job.world_size, "pids": self.pids,
                "layout": record.get("layout"), "backend": record.get("backend"), "restarts": self.restarts,
                "devices": self.devices, **({"nodes": self.hosts.nodes()} if self.hosts else {})}


def failure_status(err: RankFailure) -> int:
    """504 when the group only stalled past the deadline, else 500 (a rank died or failed)."""
    stalled = not err.died and all("stalled" in text for text in err.failures.values())
    return 504 if stalled else 500


def warmup_split(record: dict | None, graphs: bool) -> str:
    """Where a warm-up's time went, from its run record: the first step (and its one-time work), the second (the
    default size's CUDA graph captured), the text encoding and the decode."""
    if not record:
        return ""
    steps, phases = record.get("step_latency_s") or [], record.get("phases_s") or {}
    once = one_time_text(record, digits=1)
    parts = [f"first step {steps[0]:.1f} s" + (f" ({once})" if once else "")] if steps else []
    if len(steps) > 1:
        parts.append(f"{'the capture' if graphs else 'second step'} {steps[1]:.1f} s")
    parts += [f"{name.replace('_', ' ')} {phases[name]:.1f} s" for name in ("text_encoding", "decode")
              if name in phases]
    return f": {', '.join(parts)}" if parts else ""


__all__ = ["BuildTimeout", "Group", "failure_status"]

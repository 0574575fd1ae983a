"""Pools of rank processes, the parent's side: local multi-process jobs on one machine (gloo on the CPU, NCCL
with one GPU per process), and the protocol every pool speaks (`Pool`; a job across machines: remote.py).

`ProcessPool` keeps the same ranks and process group alive across many calls (a command's work run once on
every rank: run.py): a served
job's group builds its pipeline once and runs every request on it (group.py), and a test module pays the start-up
cost once. Nothing waits on a rank that is gone: a rank that dies (killed, out of
memory, exited) or raises ends the whole job within seconds, naming the rank and the cause, and its peers are
stopped; a rank that stalls ends it when its peers' collectives give up (`timeout_s`); ranks whose parent
dies exit too (rank.py is the rank's side). While a function runs, a rank may `note` its progress; the pool keeps
the latest (`last_note`) and hands each to `on_note` when set (a caller that follows every step).
Each call has a number; `cancel` asks the call in flight to stop through a value every rank can read
(`cancelled`): the ranks look at it where they agree on stopping (a step's end), so they stop together, and a
cancel that comes after its call has ended never stops the next one.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ..core.config import DEFAULT_TIMEOUT_S
from ..core.join import join_job
from . import fork_server
from .rank import parent_info, serve_rank

POLL_S = 0.5  # how often the parent looks at its ranks while it waits
GRACE_S = 5.0  # after the first failure, how long the other ranks may take to report theirs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_cause(code: int) -> str:
    """What a rank's exit code says: the signal that killed it, or the code it exited with."""
    if code < 0:
        name = signal.Signals(-code).name
        oom = " (by hand, or by the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{oom}"
    return f"exited with code {code}"


class RankFailure(RuntimeError):
    """Some ranks of a local job failed: `failures` maps each to its cause (a traceback or how it ended)."""

    def __init__(self, what: str, failures: dict[int, str], died: set[int]):
        self.what, self.failures, self.died = what, failures, died
        details = "\n".join(f"rank {r}:\n{text}" for r, text in sorted(failures.items()))
        super().__init__(f"{what} failed on {len(failures)} rank(s):\n{details}")

    @property
    def summary(self) -> str:
        """One line per distinct cause, ranks that died first (their peers' errors follow from them)."""
        causes: dict[str, list[int]] = {}
        for rank in sorted(self.failures, key=lambda r: (r not in self.died, r)):
            text = self.failures[rank].strip().splitlines() or ["no message"]
            causes.setdefault(text[-1], []).append(rank)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {cause}"
                 for cause, ranks in causes.items()]
        return f"{self.what} failed: " + "; ".join(parts)


def _init(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
          env: dict[str, str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(env or {})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    join_job(gpu=backend == "nccl", timeout_s=timeout_s)


def _ahead_in(env: dict[str, str], ahead: Callable[[], None]) -> None:
    """A rank's `ahead`, started in the pool's environment: what it starts may read it before the join sets it
    (CUDA reads CUDA_VISIBLE_DEVICES once, when it starts)."""
    os.environ.update(env)
    ahead()


class Pool:
    """The parent's side of a pool of ranks joined in one process group, running functions on every rank on
    request, whatever started the ranks (this machine's `ProcessPool`, or the launched processes of a job across
    machines: remote.py). A subclass says how a task reaches the ranks (`_post`) and which ranks have ended
    (`_ended`); answers arrive on `_outbox` as (rank, ok, value), ok None for a note.

    wait_s: how long one call may take in all before the pool gives up on it (math.inf: as long as every rank
    runs). `close(stop=True)` from another thread ends a call in flight too: it raises RankFailure at once.
    """

    grace_s = GRACE_S  # after the first failure, how long the others may take to report theirs

    def __init__(self, world_size: int, timeout_s: float, wait_s: float | None):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.wait_s = timeout_s if wait_s is None else wait_s
        self.last_note: Any = None  # the latest `note` a rank sent while a call ran
        self.on_note: Callable[[Any], None] | None = None  # called with each note, in the thread that waits
        self._outbox: Any = None  # set by the subclass: anything with get(timeout=...) and put(item)
        self._calls = 0  # the number of the latest call
        self._closed = False

    def _post(self, task: tuple | None) -> None:
        """Send a task (call, fn, args, kwargs) to every rank."""
        raise NotImplementedError

    def _ended(self) -> dict[int, str]:
        """The ranks that have ended, with why."""
        raise NotImplementedError

    def close(self, stop: bool = False) -> None:
        raise NotImplementedError

    def wait_started(self, wait_s: float | None = None) -> None:
        """Until every rank has joined the process group (RankFailure past `wait_s`, default the pool's)."""
        self._collect("start-up", self.wait_s if wait_s is None else wait_s)

    def dead(self) -> dict[int, str]:
        """The ranks that have ended, with why (between calls: a rank killed while the pool was idle)."""
        return self._ended()

    def _collect(self, what: str, wait_s: float) -> list[Any]:
        """Every rank's answer; on the first failure (an error, a rank gone) the others get GRACE_S to report
        theirs, then the pool stops and raises RankFailure."""
        results: list[Any] = [None] * self.world_size
        failures: dict[int, str] = {}
        died: set[int] = set()
        pending = set(range(self.world_size))
        started = time.monotonic()
        give_up = started + wait_s
        while pending:
            if self._closed:  # closed by another thread: nothing more will come
                failures.update(dict.fromkeys(pending, "stopped: the pool was closed"))
                break
            try:
                item = self._outbox.get(timeout=POLL_S)
                if item is None:  # `close` waking this wait: the loop's top sees the pool closed
                    continue
                rank, ok, value = item
                if ok is None:  # a note, not an answer
                    self.last_note = value
                    if self.on_note is not None:
                        self.on_note(value)
                    continue
                pending.discard(rank)
                if ok:
                    results[rank] = value
                else:
                    failures[rank] = value
            except queue.Empty:
                for rank, why in self._ended().items():
                    if rank in pending:
                        pending.discard(rank)
                        died.add(rank)
                        failures[rank] = why
            now = time.monotonic()
            if failures:
                give_up = min(give_up, now + self.grace_s)
            if pending and now > give_up:
                why = "stopped, no answer yet" if failures else f"no answer within {wait_s:.0f} s (stalled)"
                failures.update(dict.fromkeys(pending, why))
                break
        if failures:
            self.close(stop=True)
            raise RankFailure(what, failures, died)
        return results

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank (fn must be importable by name); return the per-rank results."""
        return self.run_within(self.wait_s, fn, *args, **kwargs)

    def run_within(self, wait_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`run`, given up on (RankFailure, the pool stopped) past `wait_s` seconds instead of the pool's wait_s."""
        if self._closed:
            raise RuntimeError("the process pool is closed")
        self.last_note = None
        self._calls += 1
        self._post((self._calls, fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "task"), wait_s)

    @property
    def calls(self) -> int:
        """The number of the latest call (the next one is calls + 1)."""
        return self._calls

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProcessPool(Pool):
    """`world_size` processes of this machine joined in one process group (see `Pool`).

    timeout_s: the process group's (how long a collective waits for a peer). wait_s: see `Pool` (None: timeout_s).
    env: variables set in every rank before it joins (e.g. CUDA_VISIBLE_DEVICES: which GPUs the pool's ranks get).
    wait: wait here for every rank to join; else the caller calls `wait_started` (meanwhile another thread may
    `close` the pool, e.g. a server stopping during its start-up). ahead: what each rank starts before it joins
    (`serve_rank`).
    """

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
                 wait_s: float | None = None, env: dict[str, str] | None = None, wait: bool = True,
                 ahead: Callable[[], None] | None = None):
        super().__init__(world_size, timeout_s, wait_s)
        ctx = fork_server.context()
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._cancel = ctx.Value("q", 0, lock=False)  # the number of the call to stop (one writer: this process)
        self._procs = [
            ctx.Process(target=serve_rank, daemon=True,
                        args=(r, partial(_init, r, world_size, port, backend, timeout_s, dict(env or {})),
                              parent_info(), self._inboxes[r], self._outbox, self._cancel,
                              partial(_ahead_in, dict(env or {}), ahead) if ahead else None))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        if wait:
            self.wait_started()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank order (empty once closed)."""
        return [p.pid for p in self._procs]

    def _ended(self) -> dict[int, str]:
        return {rank: exit_cause(p.exitcode) for rank, p in enumerate(self._procs) if p.exitcode is not None}

    def _post(self, task: tuple | None) -> None:
        for inbox in self._inboxes:
            inbox.put(task)

    def cancel(self, call: int) -> None:
        """Ask call number `call` (running, or the next one) to stop where its ranks next agree on it
        (`cancelled`); no other call is affected, so a cancel that comes after its call has ended is harmless."""
        self._cancel.value = call

    def close(self, stop: bool = False) -> None:
        """Let the ranks finish (their shutdown is collective), or with `stop` end them at once."""
        if stop:
            self._closed = True
            self._outbox.put(None)  # a call that waits in another thread sees it at once
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                if stop:
                    proc.terminate()
                else:
                    inbox.put(None)
        ends = time.monotonic() + (2.0 if stop else 10.0)
        for proc in self._procs:
            proc.join(timeout=max(0.0, ends - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []
        self._closed = True

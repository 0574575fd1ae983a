"""The groups' supervision: one task per group starts it, hands it the queue's requests, restarts it when a rank fails.

Each task starts its group (ranks spawned, pipeline built and warmed), then takes the oldest queued request whenever
the group is free and runs it (running.py), batched with the waiting requests of its shape (work.py's `gather`);
while the batch is smaller than the group's last of that shape, it waits up to PATIENCE of that call's time for the
rest (closed-loop clients come back a few milliseconds apart, and a batch split in two costs a call). When a rank dies, fails or stalls, the group's other ranks are stopped,
/health says 503, and the task starts the group again (rebuilt from scratch: nothing of the failed job is reused),
then goes on with the queue; a rank that ends while its group is idle is seen within WATCH_S and restarts the group
the same way, before the group takes a request. A group that fails MAX_RESTARTS times in a row is given up, and once
no group is left every queued request is answered 503 and the server stops with an error. Across machines, a group
that lost a node waits for it (its launcher restarted) rather than counting failed restarts; while every group waits
so, no request can run (`stranded`).

A part of `Service` (service.py), which holds the state named below.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..runtime.batch import batch_key
from ..runtime.group import Group
from ..runtime.job import Job
from .errors import ApiError
from .metrics import Metrics
from .validation import Limits
from .work import WorkQueue

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # consecutive failed restarts of one group before it is given up
RESTART_BURST, RESTART_WINDOW_S = 3, 60.0  # a group restarts at most this often within this window: a request
# that kills a rank each time it runs cannot keep every group rebuilding
WATCH_S = 0.5  # how often an idle group checks that its ranks are alive (a rank killed between requests)
PATIENCE = 0.05  # a batch smaller than its group's last of the same shape waits up to this share of that call


class Supervision:
    """The supervising task of each group, and a failed group's restart (a batch runs by `Running._run`)."""

    job: Job
    groups: list[Group]
    queue: WorkQueue
    metrics: Metrics
    max_batch: int
    batch_wait_s: float
    build_timeout_s: float
    limits: Future  # the request limits (serve/limits.py: found while the ranks start)
    started: float
    ready_once: bool
    draining: bool
    failure: Exception | None
    down_since: dict[int, float]
    on_ready: Callable
    on_exit: Callable[[int], None]
    _tasks: list[asyncio.Task]
    loop: asyncio.AbstractEventLoop | None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._supervise(g)) for g in self.groups]
        for task in self._tasks:
            task.add_done_callback(_said)
        loop = self.loop
        self.limits.add_done_callback(lambda found: loop.call_soon_threadsafe(self._planned, found))

    async def limits_known(self) -> Limits:
        """The request limits once the planner has them (serve/limits.py), awaited without holding the loop; a
        waiter cancelled (a client gone) leaves the planner's future as it is. Raises the planner's error."""
        await asyncio.wait([asyncio.wrap_future(self.limits)])
        return self.limits.result()

    def _planned(self, found: Future) -> None:
        """The request limits are known: a planner that refused the job ends the start at once, while the ranks
        still start (the command says why)."""
        if found.exception() is not None and not self.ready_once and self.failure is None:
            self.failure = found.exception()
            self.on_exit(1)

    async def _supervise(self, group: Group) -> None:
        failures = 0
        last: tuple = (None, 1, 0.0)  # the group's last batch: its key, images and seconds
        while True:
            if group.state != "ready":
                if (wait := restart_wait(group.restarted_at, time.monotonic())) > 0:
                    logger.warning("group %d: restarted %d times within %g s: waiting %.0f s before the next",
                                   group.index, RESTART_BURST, RESTART_WINDOW_S, wait)
                    await asyncio.sleep(wait)
                try:
                    await asyncio.to_thread(group.start, self.build_timeout_s, logger.info)
                    await self.limits_known()  # a planner's refusal fails the start: the command says it
                except Exception as err:  # noqa: BLE001 - a rank's failure (RankFailure) or the pool's own
                    group.stop(now=True)
                    if self.draining or self.queue.closed:
                        return
                    if not self.ready_once:  # a job that never built: a configuration error, said by the command
                        self.failure = err
                        self.on_exit(1)
                        return
                    failures += 1
                    logger.warning("group %d: restart %d failed: %s", group.index, failures,
                                   getattr(err, "summary", err))
                    if failures >= MAX_RESTARTS:
                        group.state = "failed"
                        await self._lost_group()
                        return
                    group.state = "recovering"
                    await asyncio.sleep(min(2.0**failures, 30.0))
                    continue
                failures = 0
                if (down := self.down_since.pop(group.index, None)) is not None:
                    logger.warning("group %d: back after %.1f s", group.index, time.monotonic() - down)
                self._group_ready()
            work = await self.queue.take(WATCH_S)
            if work is None and self.queue.closed:
                return
            if dead := group.dead():  # a rank ended between requests: rebuild before the group runs one
                if work is not None:
                    await self.queue.put_back(work)
                causes = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(dead.items()))
                await self._restart(group, causes + " while idle")
                continue
            if work is not None:
                batch, key = [work], batch_key(self.job, work.params)
                if self.max_batch > 1:
                    expect, call_s = last[1:] if last[0] == key else (1, 0.0)
                    batch = await self.queue.gather(work, lambda w: batch_key(self.job, w.params), self.max_batch,
                                                    self.batch_wait_s, expect, PATIENCE * call_s)
                started = time.monotonic()
                await self._run(group, [w for w in batch if not w.done.done()])
                last = (key, sum(w.params.n for w in batch), time.monotonic() - started)

    def _group_ready(self) -> None:
        if not self.ready_once and all(g.state == "ready" for g in self.groups):
            self.ready_once = True
            self.metrics.build_s = time.monotonic() - self.started
            self.on_ready(self)

    async def _lost_group(self) -> None:
        if all(g.state == "failed" for g in self.groups):
            logger.error("every parallel group failed to restart %d times: stopping", MAX_RESTARTS)
            await self.queue.close(ApiError(503, "no parallel group is left to run requests: the server is stopping",
                                            code="unavailable"))
            self.on_exit(1)

    async def _restart(self, group: Group, why: str) -> None:
        """Stop what is left of a group whose rank failed (in a thread: a stuck rank takes seconds to end, and the
        event loop keeps answering meanwhile); its supervising task starts it again."""
        logger.warning("group %d: %s; restarting it", group.index, why)
        group.state = "recovering"
        self.down_since.setdefault(group.index, time.monotonic())
        group.restarts += 1
        group.restarted_at = [*group.restarted_at[-RESTART_BURST:], time.monotonic()]
        self.metrics.restarted()
        await asyncio.to_thread(group.stop, True)
        group.state = "recovering"
        if group.hosts is not None and (missing := group.hosts.missing()):
            group.state = "waiting"
            logger.warning("group %d: waiting for node(s) %s to come back", group.index,
                           ", ".join(map(str, group.hosts.nodes(missing))))
            if self.stranded():
                self.queue.fail_waiting(self.stranded())

    def stranded(self) -> ApiError | None:
        """The answer to a request while every group waits for a lost node (none can run it); else None."""
        if not self.ready_once or any(g.state not in ("waiting", "failed") for g in self.groups):
            return None
        nodes = sorted({n for g in self.groups if g.hosts is not None for n in g.hosts.nodes(g.hosts.missing())})
        return ApiError(503, f"no parallel group can run requests: node(s) {', '.join(map(str, nodes))} are gone; "
                             f"they serve again once their launchers restart", code="unavailable",
                        headers={"Retry-After": "10"})


def _said(task: asyncio.Task) -> None:
    """Log a supervising task's unexpected end (else its group would stop taking requests without a word)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a parallel group's supervisor failed", exc_info=task.exception())


def restart_wait(restarted_at: list[float], now: float, burst: int = RESTART_BURST,
                 window_s: float = RESTART_WINDOW_S) -> float:
    """Seconds a group must wait before its latest restart: none until it has restarted more than `burst` times,
    then until `window_s` after the restart `burst` before the latest."""
    if len(restarted_at) <= burst:
        return 0.0
    return max(0.0, restarted_at[-burst - 1] + window_s - now)


__all__ = ["MAX_RESTARTS", "RESTART_BURST", "RESTART_WINDOW_S", "WATCH_S", "Supervision", "restart_wait"]

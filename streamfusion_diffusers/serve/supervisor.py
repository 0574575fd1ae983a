"""A parallel group's supervisor: it starts the group, runs the queue's requests on it, restarts it when a rank fails.

Its task starts the group (ranks spawned, pipeline built and warmed), then takes the oldest queued request whenever
the group is free and runs it batched with the waiting requests of its pipeline-call shape (work.py's `gather`,
runtime/batch.py), up to `max_batch` images in one call; while the batch is smaller than the group's last of that
shape, it waits up to PATIENCE of that call's time for the rest (closed-loop clients come back a few milliseconds
apart, and a batch split in two costs a call). The ranks block on their collectives in a thread, so the event loop
never does; a streamed request gets rank 0's note at each step through the loop, so the notes come before the
answer. Each answer's pixels are encoded (PNG or mp4) in a task of their own while the group already runs the next
batch; a request cancelled while it ran has its images dropped.

A rank that dies, fails or stalls answers its batch 5xx at once; the group's other ranks are stopped and the group
is started again (rebuilt from scratch: nothing of the failed job is reused), then goes on with the queue. A rank
that ends while its group is idle is seen within WATCH_S and restarts the group the same way, before it takes a
request. A batch every rank stopped together (out of memory, past its deadline) is answered 503 or 504 and the group
serves on. An error of the supervisor's own while it runs a batch (a malformed rank result) answers the batch 500
and restarts the group the same way. A group that fails MAX_RESTARTS starts in a row, or its first, is given up.
Across machines, a group that lost a node waits for it (its launcher restarted) rather than counting failed starts.
The supervisor is the one writer of its group's `GroupState`.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..runtime.batch import batch_key
from ..runtime.group import Group, failure_status
from ..runtime.job import Job
from ..runtime.output import encode
from ..runtime.pool import RankFailure
from ..runtime.progress import StepNote
from .errors import ApiError
from .metrics import Metrics
from .warm import compile_stall
from .work import Work, WorkQueue

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # consecutive failed starts of one group before it is given up
RESTART_BURST, RESTART_WINDOW_S = 3, 60.0  # a group restarts at most this often within this window: a request
# that kills a rank each time it runs cannot keep every group rebuilding
WATCH_S = 0.5  # how often an idle group checks that its ranks are alive (a rank killed between requests)
PATIENCE = 0.05  # a batch smaller than its group's last of the same shape waits up to this share of that call


class GroupState(enum.Enum):
    """A group's state, as /health and /metrics say it; its supervisor is its one writer."""

    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"  # running a batch
    RESTARTING = "restarting"
    WAITING = "waiting for a node"  # across machines: a node it needs is gone
    FAILED = "failed"  # given up
    STOPPED = "stopped"


class Supervisor:
    """One group's supervising task. It tells its service of each change of the group's state that the service
    acts on (`on_change`: ready, given up, waiting for a node), and waits for the request limits before it
    serves (`limits_known`: a planner's refusal fails the start)."""

    def __init__(self, group: Group, job: Job, queue: WorkQueue, metrics: Metrics,
                 limits_known: Callable[[], Awaitable[Any]], on_change: Callable[[Supervisor], Awaitable[None]], *,
                 request_timeout_s: float, max_batch: int = 1, batch_wait_s: float = 0.0,
                 build_timeout_s: float = math.inf):
        self.group, self.job, self.queue, self.metrics = group, job, queue, metrics
        self.limits_known, self.on_change = limits_known, on_change
        self.request_timeout_s, self.build_timeout_s = request_timeout_s, build_timeout_s
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.state = GroupState.STARTING
        self.served = False  # ready at least once: a failed start is then retried, not a configuration error
        self.error: Exception | None = None  # why it was given up
        self.down_since: float | None = None  # when it last failed, until it is back
        self.calling: list[Work] = []  # the batch its ranks run now
        self._answers: dict[asyncio.Task, Work] = {}  # answers being encoded (the group already runs the next)
        self._last: tuple = (None, 1, 0.0)  # its last batch: its key, images and seconds
        self._stalled: set[str] = set()  # the sizes whose compile stalled a call, said once each
        self._task: asyncio.Task | None = None

    @property
    def in_flight(self) -> list[Work]:
        """The requests it runs or encodes now."""
        return [*self.calling, *self._answers.values()]

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise())
        self._task.add_done_callback(_said)

    async def stop(self, now: bool) -> None:
        """End the supervising task and the ranks (the server stops): a ready group's together, unless `now`."""
        if self._task is not None:
            self._task.cancel()
        await asyncio.to_thread(self.group.stop, now or self.state is not GroupState.READY)
        self.state = GroupState.STOPPED

    async def _supervise(self) -> None:
        while True:
            if self.state is not GroupState.READY and not await self._bring_up():
                return
            work = await self.queue.take(WATCH_S)
            if work is None and self.queue.closed:
                return
            if dead := self.group.dead():  # a rank ended between requests: rebuild before the group runs one
                if work is not None:
                    await self.queue.put_back(work)
                causes = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(dead.items()))
                await self._restart(causes + " while idle")
            elif work is not None:
                await self._run_from(work)

    async def _bring_up(self) -> bool:
        """Start the group until it is ready (True), waiting between failed starts; False once it is given up or
        the server stops."""
        group, failures = self.group, 0
        loop = asyncio.get_running_loop()

        def waiting(lost: bool) -> None:  # from the start's thread
            loop.call_soon_threadsafe(self._waiting, lost)

        while True:
            if (wait := restart_wait(group.restarted_at, time.monotonic())) > 0:
                logger.warning("group %d: restarted %d times within %g s: waiting %.0f s before the next",
                               group.index, RESTART_BURST, RESTART_WINDOW_S, wait)
                await asyncio.sleep(wait)
            try:
                await asyncio.to_thread(group.start, self.build_timeout_s, logger.info, waiting)
                await self.limits_known()  # a planner's refusal fails the start: the command says it
            except Exception as err:  # noqa: BLE001 - a rank's failure (RankFailure) or the pool's own
                await asyncio.to_thread(group.stop, True)  # a stuck rank takes seconds to end
                if self.queue.closed:
                    self.state = GroupState.STOPPED
                    return False
                if self.served:
                    failures += 1
                    logger.warning("group %d: restart %d failed: %s", group.index, failures,
                                   getattr(err, "summary", err))
                if not self.served or failures >= MAX_RESTARTS:  # never built: a configuration error
                    self.state, self.error = GroupState.FAILED, err
                    await self.on_change(self)
                    return False
                self.state = GroupState.RESTARTING
                await asyncio.sleep(min(2.0**failures, 30.0))
                continue
            self.served, self.state = True, GroupState.READY
            if self.down_since is not None:
                logger.warning("group %d: back after %.1f s", group.index, time.monotonic() - self.down_since)
                self.down_since = None
            await self.on_change(self)
            return True

    def _waiting(self, lost: bool) -> None:
        """The start waits for a lost node (`lost`), or has every node now (a stopped group stays stopped)."""
        if self.state is not GroupState.STOPPED:
            self.state = GroupState.WAITING if lost else GroupState.RESTARTING if self.served else GroupState.STARTING

    async def _restart(self, why: str) -> None:
        """Stop what is left of a group whose rank failed (in a thread: a stuck rank takes seconds to end, and the
        event loop keeps answering meanwhile); the supervising task starts it again."""
        group = self.group
        logger.warning("group %d: %s; restarting it", group.index, why)
        self.state = GroupState.RESTARTING
        if self.down_since is None:
            self.down_since = time.monotonic()
        group.restarts += 1
        group.restarted_at = [*group.restarted_at[-RESTART_BURST:], time.monotonic()]
        self.metrics.restarted()
        await asyncio.to_thread(group.stop, True)
        if group.hosts is not None and (missing := group.hosts.missing()):
            self.state = GroupState.WAITING
            logger.warning("group %d: waiting for node(s) %s to come back", group.index,
                           ", ".join(map(str, group.hosts.nodes(missing))))
            await self.on_change(self)

    async def _run_from(self, work: Work) -> None:
        """Run `work` with the waiting requests of its shape (those cancelled while it gathered left out). What
        escapes the run is a failure of the supervisor itself (a malformed rank result): the batch is answered
        500 at once and the group restarted, as after a dead rank."""
        batch, key = [work], batch_key(self.job, work.params)
        try:
            if self.max_batch > 1:
                expect, call_s = self._last[1:] if self._last[0] == key else (1, 0.0)
                batch = await self.queue.gather(work, lambda w: batch_key(self.job, w.params), self.max_batch,
                                                self.batch_wait_s, expect, PATIENCE * call_s)
            started = time.monotonic()
            await self._run([w for w in batch if not w.done.done()])
        except Exception as err:  # noqa: BLE001 - any error of ours: the group is rebuilt, the server serves on
            logger.exception("group %d: its supervisor failed running a batch", self.group.index)
            why = f"its supervisor failed: {type(err).__name__}: {err}"
            for work in batch:
                work.fail(ApiError(500, f"the request failed on parallel group {self.group.index}: {why}; the group "
                                        f"restarts", code="internal_error"))
            await self._restart(why)
            return
        self._last = (key, sum(w.params.n for w in batch), time.monotonic() - started)

    async def _run(self, batch: list[Work]) -> None:
        if not batch:
            return
        started = time.monotonic()
        for work in batch:
            work.started, work.group = started, self.group
        try:
            result = await self._call(batch, max(w.deadline for w in batch) - started)
        except Exception as err:  # noqa: BLE001 - RankFailure (the pool stopped its ranks), or the pool's own error
            summary = err.summary if isinstance(err, RankFailure) else f"{type(err).__name__}: {err}"
            status = failure_status(err) if isinstance(err, RankFailure) else 500
            for work in batch:
                work.fail(ApiError(status, f"the request failed on parallel group {self.group.index}: {summary}; "
                                           f"the group restarts", code="rank_failed"))
            await self._restart(summary)
            return
        if "stopped" in result:
            for work in batch:  # cancelled ones are answered already
                work.fail(stopped_error(result, self.request_timeout_s, self.group.index))
            return
        if stall := compile_stall(result["records"]):
            self._stall(*stall)
        ran = time.monotonic()
        at = 0
        for work in batch:
            work.ran = ran
            n = work.params.n
            answer = {key: result[key][at:at + n] for key in ("pixels", "audio", "records")}
            at += n
            if work.done.done():  # cancelled while it ran: its images are dropped
                continue
            self.metrics.ran(answer["records"], ran - started)
            task = asyncio.create_task(self._answer(work, answer))
            self._answers[task] = work
            task.add_done_callback(self._answers.pop)

    def _stall(self, size: str, seconds: float) -> None:
        """A call compiled the blocks before it ran, every request behind it waiting: counted, and said once per
        size with the fix."""
        self.metrics.compile_stall(size, seconds)
        if size not in self._stalled:
            self._stalled.add(size)
            logger.warning("group %d: a request of %s waited %.1f s for the blocks to compile, and every request "
                           "behind it too: add %s to --warm-sizes to compile it before ready", self.group.index, size,
                           seconds, size)

    async def _call(self, batch: list[Work], deadline_s: float) -> dict[str, Any]:
        """The batch's pipeline call on the group's ranks, in a thread; `calling` says what runs meanwhile. A call
        that raises leaves the group busy for its caller to restart."""
        self.calling, self.state = batch, GroupState.BUSY
        try:
            result = await asyncio.to_thread(self.group.run, [w.params for w in batch], deadline_s, _notes_to(batch))
        finally:
            self.calling = []
        self.state = GroupState.READY
        return result

    async def _answer(self, work: Work, result: dict[str, Any]) -> None:
        """Encode a finished request's pixels (its image format, or mp4 with its sound muxed in) off the event loop
        and answer it: the encoded outputs, each one's sound (WAV bytes, None from a silent model) and records."""
        video, fps = self.job.spec.video, self.job.spec.fps
        try:
            outputs = await asyncio.to_thread(lambda: [encode(pixels, video, *work.image_format, fps, audio)
                                                       for pixels, audio in zip(result["pixels"], result["audio"])])
            work.encoded = time.monotonic()
            work.finish({"outputs": outputs, "audio": result["audio"], "records": result["records"]})
        except Exception as err:  # noqa: BLE001 - an encoder failure fails this request only
            logger.exception("encoding the answer failed")
            work.fail(ApiError(500, f"encoding the answer failed: {type(err).__name__}", code="encode_failed"))


def _notes_to(batch: list[Work]) -> Callable[[StepNote], None] | None:
    """What hands each step's note to the batch's streamed requests (from the group's thread, through the event
    loop, so the notes come before the answer); None when none streams, and nothing follows the steps."""
    streamed = [w for w in batch if w.steps is not None]
    if not streamed:
        return None
    loop = asyncio.get_running_loop()

    def follow(note: StepNote) -> None:
        for work in streamed:
            loop.call_soon_threadsafe(work.steps.put_nowait, note)

    return follow


def _said(task: asyncio.Task) -> None:
    """Log a supervising task's unexpected end (else its group would stop taking requests without a word)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("a parallel group's supervisor failed", exc_info=task.exception())


def stopped_error(result: dict[str, Any], request_timeout_s: float, group: int) -> ApiError:
    """The answer to a batch every rank stopped together: out of memory on a rank (503: the group serves on, a
    smaller request or a later try may fit), or past its deadline (504)."""
    at = f"after step {result['step']} of {result['steps']}"
    if result["stopped"] == "out_of_memory":
        return ApiError(503, f"parallel group {group} ran out of GPU memory {at}: the request was stopped and the "
                             f"memory freed; ask for a smaller size, fewer frames or a smaller n, or try again later",
                        code="out_of_memory", headers={"Retry-After": "1"})
    return ApiError(504, f"the request ran past --request-timeout {request_timeout_s:g} s and was stopped {at}",
                    code="timeout")


def restart_wait(restarted_at: list[float], now: float, burst: int = RESTART_BURST,
                 window_s: float = RESTART_WINDOW_S) -> float:
    """Seconds a group must wait before its latest restart: none until it has restarted more than `burst` times,
    then until `window_s` after the restart `burst` before the latest."""
    if len(restarted_at) <= burst:
        return 0.0
    return max(0.0, restarted_at[-burst - 1] + window_s - now)


__all__ = ["GroupState", "MAX_RESTARTS", "PATIENCE", "RESTART_BURST", "RESTART_WINDOW_S", "WATCH_S", "Supervisor",
           "restart_wait", "stopped_error"]

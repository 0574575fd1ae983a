"""The front and supervisor: one queue, the parallel groups, and what happens when a rank fails or a stop is asked.

The HTTP process (rank-free) owns the queue and one supervising task per group. The task starts its group
(ranks spawned, pipeline built and warmed), then takes the oldest queued request whenever the group is free and
runs it in a thread (the ranks block on their collectives, the event loop never does). When a rank dies, fails
or stalls, the request in flight is answered 5xx at once, the group's other ranks are stopped, /health says 503,
and the task starts the group again (rebuilt from scratch: nothing of the failed job is reused), then goes on
with the queue; a rank that ends while its group is idle is seen within WATCH_S and restarts the group the same
way, before the group takes a request; a group that fails MAX_RESTARTS times in a row is given up, and once no
group is left every queued request is answered 503 and the server stops with an error. Drain (SIGTERM): new
requests get 503, the requests already accepted run, then the server exits.

A free group runs the oldest request together with those of its pipeline-call shape that wait or come within
`batch_wait_s`, up to `max_batch` images, as one pipeline call (runtime/batch.py). A client that leaves (or a
video that is deleted) cancels its request: one still queued is dropped; a running one is answered 499 at once,
and its batch stops at the next step on every rank once every request of the batch is cancelled; until then the
batch runs on for the others and the cancelled request's images are dropped. The group goes on with the queue.
A streamed request gets rank 0's note at each step of its call (`stream`), previews included when it asked.

Across machines (`hosts`), a group that lost a node waits for it (its launcher restarted) rather than counting
failed restarts; while every group waits so, no request can run: the waiting ones and new ones are answered 503
at once instead of queueing until their deadline.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..runtime.batch import batch_key, unbatched_why
from ..runtime.group import Group, RankFailure, failure_status
from ..runtime.job import Job
from ..runtime.output import encode
from ..runtime.progress import StepNote
from ..runtime.remote import Hosts
from ..runtime.request import Request
from .errors import ApiError
from .metrics import Metrics
from .validation import Checker, Limits
from .videos import Keep, VideoJob, VideoStore
from .work import Work, WorkQueue

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # consecutive failed restarts of one group before it is given up
RESTART_BURST, RESTART_WINDOW_S = 3, 60.0  # a group restarts at most this often within this window: a request
# that kills a rank each time it runs cannot keep every group rebuilding
POLL_S = 0.05  # how often a waiting request checks that its client is still there (a cancel lands within a step)
WATCH_S = 0.5  # how often an idle group checks that its ranks are alive (a rank killed between requests)


class Service:
    """The served job on `len(devices)` groups, behind one bounded queue."""

    def __init__(self, job: Job, limits: Limits, devices: list[list[str] | None], max_queue: int,
                 request_timeout_s: float, on_ready: Callable[[Service], None], on_exit: Callable[[int], None],
                 keep_videos: Keep = Keep(), max_batch: int = 1, batch_wait_s: float = 0.0,
                 build_timeout_s: float = math.inf, drain_timeout_s: float = math.inf,
                 hosts: list[Hosts] | None = None):
        self.job, self.checker = job, Checker(job, limits)
        if max_batch > 1 and (why := unbatched_why(job)):
            logger.info("every request runs as its own pipeline call: %s", why)
            max_batch = 1
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        if job.stack.adapters and job.cuda_graph:
            logger.info("named LoRAs with CUDA graphs: each new choice of adapters and weights gets graphs of its "
                        "own (its first step eager, its second captured), kept with the others' within the budget")
        self.groups = [Group(i, job, d, hosts[i] if hosts else None) for i, d in enumerate(devices)]
        self.metrics = Metrics()
        self.queue = WorkQueue(max_queue, len(self.groups), lambda: self.metrics.run_s or 1.0)
        self.videos = VideoStore(keep_videos)
        self.request_timeout_s = request_timeout_s
        self.build_timeout_s, self.drain_timeout_s = build_timeout_s, drain_timeout_s
        self.on_ready, self.on_exit = on_ready, on_exit
        self.started = time.monotonic()
        self.created = int(time.time())
        self.ready_once = False
        self.draining = False
        self.failure: Exception | None = None  # why the first start failed (the command reports it)
        self.running = 0
        self.busy: set[int] = set()  # the groups running a request now
        self.active: set[Work] = set()  # the requests running or being encoded (answered 503 past a drain's bound)
        self.down_since: dict[int, float] = {}  # when each restarting group failed
        self._tasks: list[asyncio.Task] = []
        self._encoding: set[asyncio.Task] = set()  # answers being encoded (their groups already run the next)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started (signals schedule on it)

    # ---- the groups

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks = [asyncio.create_task(self._supervise(g)) for g in self.groups]
        for task in self._tasks:
            task.add_done_callback(_said)

    async def _supervise(self, group: Group) -> None:
        failures = 0
        while True:
            if group.state != "ready":
                if (wait := restart_wait(group.restarted_at, time.monotonic())) > 0:
                    logger.warning("group %d: restarted %d times within %g s: waiting %.0f s before the next",
                                   group.index, RESTART_BURST, RESTART_WINDOW_S, wait)
                    await asyncio.sleep(wait)
                try:
                    await asyncio.to_thread(group.start, self.build_timeout_s, logger.info)
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
                batch = [work]
                if self.max_batch > 1:
                    batch = await self.queue.gather(work, lambda w: batch_key(self.job, w.params), self.max_batch,
                                                    self.batch_wait_s)
                await self._run(group, [w for w in batch if not w.done.done()])

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

    async def _run(self, group: Group, batch: list[Work]) -> None:
        if not batch:  # every request of it was cancelled while it gathered
            return
        started = time.monotonic()
        for work in batch:
            work.started, work.group = started, group
            self.active.add(work)
            work.done.add_done_callback(lambda _, w=work: self.active.discard(w))
        self.running += len(batch)
        deadline = max(w.deadline for w in batch)
        self.busy.add(group.index)
        try:
            result = await asyncio.to_thread(group.run, [w.params for w in batch], deadline - started,
                                             self._follower(batch))
        except Exception as err:  # noqa: BLE001 - RankFailure (the pool stopped its ranks), or the pool's own error
            self.running -= len(batch)
            summary = err.summary if isinstance(err, RankFailure) else f"{type(err).__name__}: {err}"
            status = failure_status(err) if isinstance(err, RankFailure) else 500
            for work in batch:
                work.fail(ApiError(status, f"the request failed on parallel group {group.index}: {summary}; the "
                                           f"group restarts", code="rank_failed"))
            await self._restart(group, summary)
            return
        finally:
            self.busy.discard(group.index)
        if "stopped" in result:
            self.running -= len(batch)
            for work in batch:  # cancelled ones are answered already
                work.fail(stopped_error(result, self.request_timeout_s, group.index))
            return
        seconds = time.monotonic() - started
        at = 0
        for work in batch:
            n = work.params.n
            answer = {"pixels": result["pixels"][at:at + n], "records": result["records"][at:at + n]}
            at += n
            if work.done.done():  # cancelled while it ran: its images are dropped
                self.running -= 1
                continue
            self.metrics.ran(answer["records"], seconds)
            self._encoding.add(task := asyncio.create_task(self._answer(work, answer)))  # the group takes the next
            task.add_done_callback(self._encoding.discard)

    def _follower(self, batch: list[Work]) -> Callable[[StepNote], None] | None:
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

    async def _answer(self, work: Work, result: dict[str, Any]) -> None:
        """Encode a finished request's pixels (PNG or mp4) off the event loop and answer it; its group is free."""
        video = self.job.spec.video
        try:
            outputs = await asyncio.to_thread(lambda: [encode(pixels, video) for pixels in result["pixels"]])
            work.finish({"outputs": outputs, "records": result["records"]})
        except Exception as err:  # noqa: BLE001 - an encoder failure fails this request only
            logger.exception("encoding the answer failed")
            work.fail(ApiError(500, f"encoding the answer failed: {type(err).__name__}", code="encode_failed"))
        finally:
            self.running -= 1

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

    # ---- requests

    def stranded(self) -> ApiError | None:
        """The answer to a request while every group waits for a lost node (none can run it); else None."""
        if not self.ready_once or any(g.state not in ("waiting", "failed") for g in self.groups):
            return None
        nodes = sorted({n for g in self.groups if g.hosts is not None for n in g.hosts.nodes(g.hosts.missing())})
        return ApiError(503, f"no parallel group can run requests: node(s) {', '.join(map(str, nodes))} are gone; "
                             f"they serve again once their launchers restart", code="unavailable",
                        headers={"Retry-After": "10"})

    async def submit(self, kind: str, params: Request, streamed: bool = False) -> Work:
        """Queue a checked request (429 when full, 503 when draining, stopped, or no group can run it); a
        `streamed` one follows its steps (`stream`)."""
        if error := self.stranded():
            raise error
        work = Work(kind, params, deadline=time.monotonic() + self.request_timeout_s)
        if streamed:
            work.steps = asyncio.Queue()
        await self.queue.put(work)
        return work

    async def wait(self, work: Work, disconnected: Callable[[], Any]) -> dict[str, Any]:
        """The request's result; a client that leaves before its request starts drops it from the queue."""
        async for _ in self.stream(work, disconnected):
            pass
        return work.done.result()

    async def stream(self, work: Work, disconnected: Callable[[], Any]) -> AsyncIterator[StepNote]:
        """A submitted request's step notes as they come (none unless it was submitted `streamed`), until its
        result is in `work.done` (an ApiError raised here); a client that leaves cancels it (`wait`)."""
        try:
            async for note in self._follow(work, disconnected):
                yield note
        finally:  # the stream's reader went away mid-request (its response closed): as a client that leaves
            if not work.done.done() and not self.cancel(work) and work.started is None and self.queue.drop(work):
                self.metrics.dropped()
                work.fail(ApiError(499, "the client closed the connection before the request started",
                                   code="dropped"))

    async def _follow(self, work: Work, disconnected: Callable[[], Any]) -> AsyncIterator[StepNote]:
        while True:
            if work.steps is not None:
                while not work.steps.empty():
                    yield work.steps.get_nowait()
            done, _ = await asyncio.wait({work.done}, timeout=POLL_S)
            if done:
                while work.steps is not None and not work.steps.empty():
                    yield work.steps.get_nowait()
                work.done.result()  # raises the request's ApiError
                return
            if work.started is None and time.monotonic() > work.deadline and self.queue.drop(work):
                raise ApiError(504, "the request waited past --request-timeout in the queue and did not run",
                               code="timeout")
            if await disconnected():
                if self.cancel(work):
                    raise ApiError(499, "the client closed the connection: its request was stopped", code="cancelled")
                if work.started is None and self.queue.drop(work):
                    self.metrics.dropped()
                    raise ApiError(499, "the client closed the connection before the request started",
                                   code="dropped")

    def cancel(self, work: Work) -> bool:
        """Cancel a running request (answered 499; its batch stops once every request of it is cancelled);
        False when it is not running."""
        if work.started is None or work.done.done() or not work.group.cancel(work.params.id):
            return False
        self.metrics.cancelled()
        work.fail(ApiError(499, "the request was cancelled while it ran", code="cancelled"))
        return True

    def delete_video(self, job: VideoJob) -> None:
        """Stop a video job where it is (dropped from the queue, or cancelled while it runs) and forget it."""
        if job.work.started is None and self.queue.drop(job.work):
            job.work.fail(ApiError(499, "the video was deleted before it started", code="cancelled"))
        else:
            self.cancel(job.work)
        self.videos.forget(job.id)

    async def submit_video(self, params: Request) -> VideoJob:
        work = await self.submit("video", params)
        job = self.videos.add(self.job.model, work)
        work.done.add_done_callback(lambda _: self._video_done(job))
        return job

    def _video_done(self, job: VideoJob) -> None:
        error = job.work.done.exception()
        if error is None:
            result = job.work.done.result()
            self.videos.complete(job, result["outputs"][0], what_ran(job.work, result))
        elif isinstance(error, ApiError):
            self.videos.fail(job, error.code or "failed", error.message)
        else:
            self.videos.fail(job, "failed", str(error))

    # ---- state

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while at least one group serves (ready or busy) and the server takes requests; else 503 and why.
        Each group says its own state: starting, ready, busy, restarting, failed or stopped."""
        states = {g.state for g in self.groups}
        if self.draining:
            status = "draining"
        elif "ready" in states:
            status = "ready"
        elif "failed" in states and states <= {"failed", "stopped"}:
            status = "failed"
        else:
            status = "recovering" if self.ready_once else "starting"
        # no process ids: /health takes no key, and pids help only someone on the machine already
        groups = [{**{k: v for k, v in g.describe().items() if k != "pids"}, "state": self._group_state(g)}
                  for g in self.groups]
        body = {"status": status, "model": self.job.model, "queue": len(self.queue), "running": self.running,
                "groups": groups}
        return (200 if status == "ready" else 503), body

    def _group_state(self, group: Group) -> str:
        if group.state == "ready":
            return "busy" if group.index in self.busy else "ready"
        return {"recovering": "restarting", "waiting": "waiting for a node"}.get(group.state, group.state)

    def render_metrics(self) -> bytes:
        return self.metrics.render(len(self.queue), self.running, dict(Counter(g.state for g in self.groups)))

    async def drain(self) -> None:
        """Refuse new requests (503), let the accepted ones run for up to the drain's bound (past it, what is
        still queued or running is answered 503), then ask the server to exit (0)."""
        if self.draining:
            return
        self.draining = True
        await self.queue.close()
        ends = time.monotonic() + self.drain_timeout_s
        while len(self.queue) or self.running:
            if not any(g.state in ("ready", "starting", "recovering") for g in self.groups):
                break
            if time.monotonic() > ends:
                logger.warning("%d request(s) still queued or running --drain-timeout %g s after the stop: answered "
                               "503", len(self.queue) + len(self.active), self.drain_timeout_s)
                error = ApiError(503, f"the server stopped: the request was not done --drain-timeout "
                                      f"{self.drain_timeout_s:g} s after the stop was asked", code="unavailable")
                await self.queue.close(error)
                for work in list(self.active):
                    work.fail(error)
                break
            await asyncio.sleep(0.1)
        self.on_exit(0)

    async def close(self) -> None:
        """Stop everything: answer what still waits with 503, end the supervising tasks, stop the ranks (a
        ready group together, the others at once), remove the finished videos."""
        await self.queue.close(ApiError(503, "the server stopped before the request ran", code="unavailable"))
        for task in self._tasks:
            task.cancel()
        for group in self.groups:
            await asyncio.to_thread(group.stop, group.state != "ready" or self.running > 0)
        self.videos.close()


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


def what_ran(work: Work, result: dict[str, Any]) -> dict[str, Any]:
    """The answer's extra field: the group, the time queued and in all, the seeds, and each generation's record
    (what run.json holds)."""
    return {"group": work.group.index, "queued_s": work.started - work.arrived, "seconds": time.monotonic() -
            work.arrived, "seeds": [work.params.seed + i for i in range(work.params.n)], "runs": result["records"]}


__all__ = ["Service", "restart_wait", "stopped_error", "what_ran"]

"""The front's service: the served job on its parallel groups behind one bounded queue, its videos, /health, drain.

The HTTP process (rank-free) owns the queue and what the app asks of the job: a request accepted (`submit`, 429
when the queue is full, 503 when draining, stopped, or while every group waits for a lost node), followed to its
answer (follower.py), its video job, the state said by /health and /metrics, the drain and the stop. Each group has
its supervisor (supervisor.py: started, handed the queue's batches, restarted when a rank fails), which tells the
service when the group is ready, given up or waiting for a node: once every group is given up, every queued request
is answered 503 and the server stops with an error. Drain (SIGTERM): new requests get 503, the requests already
accepted run (for up to --drain-timeout), then the server exits.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from ..runtime.batch import unbatched_why
from ..runtime.group import Group
from ..runtime.job import Job
from ..runtime.output import PNG
from ..runtime.progress import StepNote
from ..runtime.remote import Hosts
from ..runtime.request import Request
from .errors import ApiError
from .follower import Follower
from .metrics import Metrics
from .supervisor import MAX_RESTARTS, GroupState, Supervisor
from .limits import Limits
from .validation import Checker
from .videos import Keep, VideoJob, VideoStore
from .warm import warm_shapes
from .work import Work, WorkQueue

logger = logging.getLogger(__name__)


class Service:
    """The served job on `len(devices)` groups, behind one bounded queue."""

    def __init__(self, job: Job, limits: Limits | Future, devices: list[list[str] | None], max_queue: int,
                 request_timeout_s: float, on_ready: Callable[[Service], None], on_exit: Callable[[int], None],
                 keep_videos: Keep = Keep(), max_batch: int = 1, batch_wait_s: float = 0.0,
                 build_timeout_s: float = math.inf, drain_timeout_s: float = math.inf,
                 hosts: list[Hosts] | None = None, warm_sizes: tuple[tuple[int, int], ...] = ()):
        self.job = job
        if isinstance(limits, Limits):
            limits, known = Future(), limits
            limits.set_result(known)
        self.limits = limits  # the memory planner's, found beside the ranks' start (`planned`)
        self._checker: Checker | None = None
        if max_batch > 1 and (why := unbatched_why(job)):
            logger.info("every request runs as its own pipeline call: %s", why)
            max_batch = 1
        if job.stack.adapters and job.cuda_graph:
            logger.info("named LoRAs with CUDA graphs: each new choice of adapters and weights gets graphs of its "
                        "own (its first step eager, its second captured), kept with the others' within the budget")
        if job.gpu:
            logger.info("CUDA graphs %s (%s); the repeated blocks %s (%s)", "on" if job.cuda_graph else "off",
                        job.graph_why, "compile in the warm-up" if job.compile else "run eager", job.compile_why)
        sizes = warm_sizes or ((job.width, job.height),)
        if job.compile:
            logger.info("the blocks compile before ready for %s, at 1%s image(s) a call, kept in %s",
                        ", ".join(f"{w}x{h}" for w, h in sizes), f" and {max_batch}" if max_batch > 1 else "",
                        job.compile_cache)
        warm = warm_shapes(job, sizes, max_batch)
        self.groups = [Group(i, job, d, warm, hosts[i] if hosts else None) for i, d in enumerate(devices)]
        self.metrics = Metrics()
        self.queue = WorkQueue(max_queue, len(self.groups), lambda: self.metrics.run_s or 1.0)
        self.supervisors = [Supervisor(group, job, self.queue, self.metrics, self.limits_known, self._changed,
                                       request_timeout_s=request_timeout_s, max_batch=max_batch,
                                       batch_wait_s=batch_wait_s, build_timeout_s=build_timeout_s)
                            for group in self.groups]
        self.follower = Follower(self.queue, self.metrics)
        self.videos = VideoStore(keep_videos)
        self._saving: set[asyncio.Task] = set()  # finished videos being written
        self.request_timeout_s, self.drain_timeout_s = request_timeout_s, drain_timeout_s
        self.on_ready, self.on_exit = on_ready, on_exit
        self.started = time.monotonic()
        self.created = int(time.time())
        self.ready_once = False
        self.draining = False
        self.failure: Exception | None = None  # why the first start failed (the command reports it)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started (signals schedule on it)

    async def start(self) -> None:
        """Start every group's supervisor; a planner that refuses the job ends the start at once (`_planned`)."""
        self.loop = loop = asyncio.get_running_loop()
        for supervisor in self.supervisors:
            supervisor.start()
        self.limits.add_done_callback(lambda found: loop.call_soon_threadsafe(self._planned, found))

    async def limits_known(self) -> Limits:
        """The request limits once the planner has them (serve/limits.py), awaited without holding the loop; a
        waiter cancelled (a client gone) leaves the planner's future as it is. Raises the planner's error, read from
        the loop's copy of the future too (else asyncio logs it as never retrieved once the copy is collected)."""
        waiting = asyncio.wrap_future(self.limits)
        waiting.add_done_callback(lambda copy: copy.cancelled() or copy.exception())
        await asyncio.wait([waiting])
        return self.limits.result()

    def _planned(self, found: Future) -> None:
        """The request limits are known: a planner that refused the job ends the start at once, while the ranks
        still start (the command says why)."""
        if found.exception() is not None and not self.ready_once and self.failure is None:
            self.failure = found.exception()
            self.on_exit(1)

    async def planned(self) -> None:
        """Wait, without holding the server's loop, until the request limits are known: on GPUs the memory planner
        finds them while the ranks start. Every route that checks a request waits here first."""
        try:
            await self.limits_known()
        except Exception:  # noqa: BLE001 - the server is stopping: the command says why
            raise ApiError(503, "the server could not start: no request limits", code="unavailable") from None

    @property
    def checker(self) -> Checker:
        """The checks of every request, against the limits (a route has waited for them: `planned`)."""
        if self._checker is None:
            self._checker = Checker(self.job, self.limits.result(timeout=0))
        return self._checker

    def taking(self) -> None:
        """Refuse a new request while the server drains (503)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")

    # ---- requests

    async def submit(self, kind: str, params: Request, streamed: bool = False,
                     image_format: tuple[str, int] = PNG) -> Work:
        """Queue a checked request (429 when full, 503 when draining, stopped, or no group can run it); a
        `streamed` one follows its steps (`stream`); its images are answered in `image_format`."""
        if error := self.stranded():
            raise error
        work = Work(kind, params, deadline=time.monotonic() + self.request_timeout_s, image_format=image_format)
        if streamed:
            work.steps = asyncio.Queue()
        await self.queue.put(work)
        return work

    async def wait(self, work: Work, disconnected: Callable[[], Any]) -> dict[str, Any]:
        """A submitted request's result (follower.py); its client gone, it is dropped or cancelled."""
        return await self.follower.wait(work, disconnected)

    def stream(self, work: Work, disconnected: Callable[[], Any]) -> AsyncIterator[StepNote]:
        """A submitted request's step notes until its result (follower.py)."""
        return self.follower.stream(work, disconnected)

    def stranded(self) -> ApiError | None:
        """The answer to a request while every group waits for a lost node (none can run it); else None."""
        if not self.ready_once or any(s.state not in (GroupState.WAITING, GroupState.FAILED)
                                      for s in self.supervisors):
            return None
        nodes = sorted({n for g in self.groups if g.hosts is not None for n in g.hosts.nodes(g.hosts.missing())})
        return ApiError(503, f"no parallel group can run requests: node(s) {', '.join(map(str, nodes))} are gone; "
                             f"they serve again once their launchers restart", code="unavailable",
                        headers={"Retry-After": "10"})

    # ---- the groups

    async def _changed(self, supervisor: Supervisor) -> None:
        """A group became ready, was given up, or waits for a lost node: what the server does about it."""
        state = supervisor.state
        if state is GroupState.READY and not self.ready_once and all(s.served for s in self.supervisors):
            self.ready_once = True
            self.metrics.build_s = time.monotonic() - self.started
            self.on_ready(self)
        elif state is GroupState.FAILED and not self.ready_once:  # a job that never built: a configuration error
            if self.failure is None:
                self.failure = supervisor.error
            self.on_exit(1)
        elif state is GroupState.FAILED and all(s.state is GroupState.FAILED for s in self.supervisors):
            logger.error("every parallel group failed to restart %d times: stopping", MAX_RESTARTS)
            await self.queue.close(ApiError(503, "no parallel group is left to run requests: the server is stopping",
                                            code="unavailable"))
            self.on_exit(1)
        elif state is GroupState.WAITING and (error := self.stranded()):
            self.queue.fail_waiting(error)

    @property
    def running(self) -> int:
        """The requests running on a group or being encoded."""
        return sum(len(s.in_flight) for s in self.supervisors)

    # ---- videos

    def delete_video(self, job: VideoJob) -> None:
        """Stop a video job where it is (dropped from the queue, or cancelled while it runs) and forget it."""
        if job.work.started is None and self.queue.drop(job.work):
            job.work.fail(ApiError(499, "the video was deleted before it started", code="cancelled"))
        else:
            self.follower.cancel(job.work)
        self.videos.forget(job.id)

    async def submit_video(self, params: Request) -> VideoJob:
        work = await self.submit("video", params)
        job = self.videos.add(self.job.model, work)
        work.done.add_done_callback(lambda _: self._keeping(self._video_done(job)))
        return job

    def _keeping(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` in a task held until it ends (the loop keeps only weak references to tasks)."""
        self._saving.add(task := asyncio.create_task(coroutine))
        task.add_done_callback(self._saving.discard)

    async def _video_done(self, job: VideoJob) -> None:
        error = job.work.done.exception()
        if error is None:
            result = job.work.done.result()
            await self.videos.complete(job, result["outputs"][0], what_ran(job.work, result), result["audio"][0])
        elif isinstance(error, ApiError):
            self.videos.fail(job, error.code or "failed", error.message)
        else:
            self.videos.fail(job, "failed", str(error))

    # ---- state

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while at least one group serves (ready or busy) and the server takes requests; else 503 and why.
        Each group says its own state (`GroupState`)."""
        states = {s.state for s in self.supervisors}
        if self.draining:
            status = "draining"
        elif states & {GroupState.READY, GroupState.BUSY}:
            status = "ready"
        elif GroupState.FAILED in states and states <= {GroupState.FAILED, GroupState.STOPPED}:
            status = "failed"
        else:
            status = "recovering" if self.ready_once else "starting"
        # no process ids: /health takes no key, and pids help only someone on the machine already
        groups = [{**{k: v for k, v in s.group.describe().items() if k != "pids"}, "state": s.state.value}
                  for s in self.supervisors]
        body = {"status": status, "model": self.job.model, "queue": len(self.queue), "running": self.running,
                "groups": groups, **({"compile_cache": self.job.compile_cache} if self.job.compile else {})}
        return (200 if status == "ready" else 503), body

    def render_metrics(self) -> bytes:
        counts = Counter(s.state for s in self.supervisors)
        return self.metrics.render(len(self.queue), self.running, {state.value: counts[state] for state in GroupState})

    async def drain(self) -> None:
        """Refuse new requests (503), let the accepted ones run for up to the drain's bound (past it, what is
        still queued or running is answered 503), then ask the server to exit (0)."""
        if self.draining:
            return
        self.draining = True
        await self.queue.close()
        ends = time.monotonic() + self.drain_timeout_s
        while len(self.queue) or self.running:
            if not any(s.state in (GroupState.READY, GroupState.BUSY, GroupState.STARTING, GroupState.RESTARTING)
                       for s in self.supervisors):
                break
            if time.monotonic() > ends:
                in_flight = [w for s in self.supervisors for w in s.in_flight if not w.done.done()]
                logger.warning("%d request(s) still queued or running --drain-timeout %g s after the stop: answered "
                               "503", len(self.queue) + len(in_flight), self.drain_timeout_s)
                error = ApiError(503, f"the server stopped: the request was not done --drain-timeout "
                                      f"{self.drain_timeout_s:g} s after the stop was asked", code="unavailable")
                await self.queue.close(error)
                for work in in_flight:
                    work.fail(error)
                break
            await asyncio.sleep(0.1)
        self.on_exit(0)

    async def close(self) -> None:
        """Stop everything: answer what still waits with 503, end the supervising tasks, stop the ranks (a
        ready group together, the others at once), remove the finished videos."""
        await self.queue.close(ApiError(503, "the server stopped before the request ran", code="unavailable"))
        now = self.running > 0
        await asyncio.gather(*(supervisor.stop(now) for supervisor in self.supervisors))
        await asyncio.to_thread(self.videos.close)


def what_ran(work: Work, result: dict[str, Any]) -> dict[str, Any]:
    """The answer's extra field: the group, where the server's time went (queued, the group's call with the
    pixels' way back, encoding, in all), the seeds, and each generation's record (what run.json holds)."""
    return {"group": work.group.index, "queued_s": work.started - work.arrived,
            "running_s": work.ran - work.started, "encode_s": work.encoded - work.ran,
            "seconds": time.monotonic() - work.arrived,
            "seeds": [work.params.seed + i for i in range(work.params.n)], "runs": result["records"]}


__all__ = ["Service", "what_ran"]

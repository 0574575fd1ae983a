"""The front's service: the served job on its parallel groups behind one bounded queue, its videos, /health, drain.

The HTTP process (rank-free) owns the queue and one supervising task per group. `Service` holds the state and is
made of one part per job: supervision.py (each group started, handed requests, restarted when a rank fails),
running.py (a batch run on its group, its answers encoded), following.py (a request from its client's side:
submitted, followed step by step, dropped or cancelled when its client leaves); here, the video jobs, the state
said by /health and /metrics, and the stop. Drain (SIGTERM): new requests get 503, the requests already accepted run
(for up to --drain-timeout), then the server exits.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..runtime.batch import unbatched_why
from ..runtime.group import Group
from ..runtime.job import Job
from ..runtime.remote import Hosts
from ..runtime.request import Request
from .errors import ApiError
from .following import Following
from .metrics import Metrics
from .running import Running, stopped_error
from .supervision import Supervision, restart_wait
from .validation import Checker, Limits
from .videos import Keep, VideoJob, VideoStore
from .work import Work, WorkQueue

logger = logging.getLogger(__name__)


class Service(Supervision, Running, Following):
    """The served job on `len(devices)` groups, behind one bounded queue."""

    def __init__(self, job: Job, limits: Limits | Future, devices: list[list[str] | None], max_queue: int,
                 request_timeout_s: float, on_ready: Callable[[Service], None], on_exit: Callable[[int], None],
                 keep_videos: Keep = Keep(), max_batch: int = 1, batch_wait_s: float = 0.0,
                 build_timeout_s: float = math.inf, drain_timeout_s: float = math.inf,
                 hosts: list[Hosts] | None = None):
        self.job = job
        if isinstance(limits, Limits):
            limits, known = Future(), limits
            limits.set_result(known)
        self.limits = limits  # the memory planner's, found beside the ranks' start (`planned`)
        self._checker: Checker | None = None
        if max_batch > 1 and (why := unbatched_why(job)):
            logger.info("every request runs as its own pipeline call: %s", why)
            max_batch = 1
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        if job.stack.adapters and job.cuda_graph:
            logger.info("named LoRAs with CUDA graphs: each new choice of adapters and weights gets graphs of its "
                        "own (its first step eager, its second captured), kept with the others' within the budget")
        if job.gpu:
            logger.info("CUDA graphs %s (%s); the repeated blocks %s (%s)", "on" if job.cuda_graph else "off",
                        job.graph_why, "compile in the warm-up's first step" if job.compile else "run eager",
                        job.compile_why)
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

    # ---- videos

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


def what_ran(work: Work, result: dict[str, Any]) -> dict[str, Any]:
    """The answer's extra field: the group, where the server's time went (queued, the group's call with the
    pixels' way back, encoding, in all), the seeds, and each generation's record (what run.json holds)."""
    return {"group": work.group.index, "queued_s": work.started - work.arrived,
            "running_s": work.ran - work.started, "encode_s": work.encoded - work.ran,
            "seconds": time.monotonic() - work.arrived,
            "seeds": [work.params.seed + i for i in range(work.params.n)], "runs": result["records"]}


__all__ = ["Service", "what_ran"]

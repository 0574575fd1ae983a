"""A request from its client's side: queued, followed until its answer (step by step when streamed), and stopped
when its client leaves.

`submit` queues a checked request (429 when the queue is full, 503 when draining, stopped, or while every group
waits for a lost node). A client that leaves cancels its request: one still queued is dropped; a running one is
answered 499 at once, and its batch stops at the next step on every rank once every request of the batch is
cancelled (until then the batch runs on for the others). A request still queued past its deadline is answered 504.

A part of `Service` (service.py), which holds the state named below.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..runtime.output import PNG
from ..runtime.progress import StepNote
from ..runtime.request import Request
from .errors import ApiError
from .metrics import Metrics
from .work import Work, WorkQueue

POLL_S = 0.05  # how often a waiting request checks that its client is still there (a cancel lands within a step)


class Following:
    """Submitting a request, following it to its answer, and cancelling it (the groups' state from
    `Supervision.stranded`)."""

    queue: WorkQueue
    metrics: Metrics
    request_timeout_s: float

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


__all__ = ["POLL_S", "Following"]

"""An accepted request from its client's side: followed until its answer (step by step when streamed), stopped when
its client leaves.

A client that leaves cancels its request: one still queued is dropped; a running one is answered 499 at once, and
its batch stops at the next step on every rank once every request of the batch is cancelled (until then the batch
runs on for the others). A request still queued past its deadline is answered 504.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..runtime.progress import StepNote
from .errors import ApiError
from .metrics import Metrics
from .work import Work, WorkQueue

POLL_S = 0.05  # how often a waiting request checks that its client is still there (a cancel lands within a step)


class Follower:
    """Follows the requests of `queue` to their answers, and cancels them."""

    def __init__(self, queue: WorkQueue, metrics: Metrics):
        self.queue, self.metrics = queue, metrics

    async def wait(self, work: Work, disconnected: Callable[[], Any]) -> dict[str, Any]:
        """The request's result; a client that leaves before its request starts drops it from the queue."""
        async for _ in self.stream(work, disconnected):
            pass
        return work.done.result()

    async def stream(self, work: Work, disconnected: Callable[[], Any]) -> AsyncIterator[StepNote]:
        """A request's step notes as they come (none unless it was submitted streamed), until its result is in
        `work.done` (an ApiError raised here); a client that leaves cancels it (`wait`)."""
        try:
            async for note in self._follow(work, disconnected):
                yield note
        finally:  # the stream's reader went away mid-request (its response closed): as a client that leaves
            if not work.done.done() and not self.cancel(work) and self._dropped(work):
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
                if self._dropped(work):
                    raise ApiError(499, "the client closed the connection before the request started",
                                   code="dropped")

    def _dropped(self, work: Work) -> bool:
        """Drop a request that has not started from the queue (its client left); False when it started."""
        if work.started is not None or not self.queue.drop(work):
            return False
        self.metrics.dropped()
        return True

    def cancel(self, work: Work) -> bool:
        """Cancel a running request (answered 499; its batch stops once every request of it is cancelled);
        False when it is not running."""
        if work.started is None or work.done.done() or not work.group.cancel(work.params.id):
            return False
        self.metrics.cancelled()
        work.fail(ApiError(499, "the request was cancelled while it ran", code="cancelled"))
        return True


__all__ = ["POLL_S", "Follower"]

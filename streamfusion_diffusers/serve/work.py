"""The one bounded queue in front of the parallel groups: arrival order, a free group takes the oldest.

Beyond `limit` waiting requests a new one gets 429 with Retry-After (the expected wait for a place); a client
that disconnects while its request waits is dropped from the queue; a request whose deadline passes while it
waits is answered 504 without running. A free group takes the oldest request and those of its pipeline-call shape
that wait or come within a short window (`gather`), to run them as one call. Closing (drain) refuses new requests with 503 and lets the groups take
what is already queued.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError
from ..runtime.output import PNG
from ..runtime.request import Request


LINGER = 4  # a batch's window stays open while its requests keep coming, up to this many times the wait


@dataclass(eq=False)
class Work:
    """One accepted request, from arrival to answer (`done` holds the result or an ApiError)."""

    kind: str  # "image" or "video"
    params: Request
    deadline: float  # time.monotonic() past which it is answered 504
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None
    ran: float | None = None  # when its group's call returned
    encoded: float | None = None  # when its pixels were encoded
    group: Any = None  # the group running it
    steps: asyncio.Queue | None = None  # a streamed request's step notes (runtime/progress.py's StepNote), in order
    image_format: tuple[str, int] = PNG  # how its images are encoded: OpenAI's output_format and compression
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def finish(self, result: Any) -> None:
        if not self.done.done():
            self.done.set_result(result)

    def fail(self, error: ApiError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # retrieved: an unawaited failure (a video job) is not logged as lost


class WorkQueue:
    """FIFO of Work, at most `limit` waiting; `service_s()` estimates one request's seconds (for Retry-After)."""

    def __init__(self, limit: int, groups: int, service_s: Callable[[], float]):
        self.limit, self.groups, self.service_s = limit, groups, service_s
        self._items: deque[Work] = deque()
        self._changed = asyncio.Condition()
        self.closed = False

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, work: Work) -> None:
        if self.closed:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")
        if len(self._items) >= self.limit:
            wait = math.ceil(self.service_s() * (len(self._items) + 1) / self.groups)
            raise ApiError(429, f"the queue is full ({self.limit} waiting, --max-queue): retry after {max(wait, 1)} s",
                           code="queue_full", kind="rate_limit_exceeded", headers={"Retry-After": str(max(wait, 1))})
        async with self._changed:
            self._items.append(work)
            self._changed.notify_all()

    async def take(self, wait_s: float | None = None) -> Work | None:
        """The oldest waiting request (requests past their deadline are answered 504 here); None once closed and
        empty, or when none came within `wait_s`."""
        async with self._changed:
            while True:
                while self._items:
                    work = self._items.popleft()
                    if time.monotonic() < work.deadline:
                        return work
                    work.fail(ApiError(504, "the request waited past --request-timeout in the queue and did not run",
                                       code="timeout"))
                if self.closed:
                    return None
                try:
                    await asyncio.wait_for(self._changed.wait(), wait_s)
                except asyncio.TimeoutError:
                    return None

    async def gather(self, first: Work, key: Callable[[Work], Any], max_images: int, wait_s: float,
                     expect: int = 1, patience_s: float = 0.0) -> list[Work]:
        """`first` and the waiting requests of its key, oldest first, while their images fit `max_images` (a
        request alone may have more). Those that come later join while they keep coming: the window closes
        `wait_s` after the last one joined (a burst whose requests land a few milliseconds apart is one batch),
        and at most LINGER x `wait_s` after `first`. While fewer than `expect` images are gathered (the last batch
        of this key had that many: its clients are likely on their way back, their answers sent a moment apart),
        it waits up to `patience_s` for them instead: a batch split in two runs the GPU twice for what one call
        does. Requests of other keys keep their places."""
        batch, images, want = [first], first.params.n, key(first)
        began = time.monotonic()
        ends, latest, patience_ends = began + wait_s, began + LINGER * wait_s, began + max(wait_s, patience_s)
        async with self._changed:
            while True:
                for work in list(self._items):
                    if images + work.params.n <= max_images and key(work) == want and time.monotonic() < work.deadline:
                        self._items.remove(work)
                        batch.append(work)
                        images += work.params.n
                        ends = min(time.monotonic() + wait_s, latest)
                left = (ends if images >= min(expect, max_images) else max(ends, patience_ends)) - time.monotonic()
                if images >= max_images or left <= 0 or self.closed:
                    return batch
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def put_back(self, work: Work) -> None:
        """Return a request taken but not started to the head of the queue (its group could not run it)."""
        async with self._changed:
            self._items.appendleft(work)
            self._changed.notify_all()

    def drop(self, work: Work) -> bool:
        """Remove a request that has not started (its client left); False if it already started."""
        try:
            self._items.remove(work)
        except ValueError:
            return False
        return True

    def fail_waiting(self, error: ApiError) -> None:
        """Answer every waiting request with `error` (no group can run them now); new ones still come."""
        while self._items:
            self._items.popleft().fail(error)

    async def close(self, fail: ApiError | None = None) -> None:
        """No new requests; with `fail`, answer every waiting one with it (no group will run them)."""
        self.closed = True
        async with self._changed:
            while fail is not None and self._items:
                self._items.popleft().fail(fail)
            self._changed.notify_all()


__all__ = ["Work", "WorkQueue"]

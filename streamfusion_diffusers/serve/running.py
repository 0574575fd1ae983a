"""One batch on a free group: run in a thread, its results split back to its requests and encoded off the loop.

A free group runs the oldest request together with those of its pipeline-call shape that wait or come within
`batch_wait_s`, up to `max_batch` images, as one pipeline call (runtime/batch.py). The ranks block on their
collectives in a thread, so the event loop never does. A rank that fails answers the batch 5xx at once and restarts
the group (supervision.py); a batch every rank stopped together (out of memory, past its deadline) is answered 503 or
504 and the group serves on. A request cancelled while it ran has its images dropped. Each answer's pixels are
encoded (PNG or mp4) in a task of their own while the group already runs the next batch. A streamed request gets
rank 0's note at each step of its call, through the event loop, so the notes come before the answer.

A part of `Service` (service.py), which holds the state named below.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..runtime.group import Group, failure_status
from ..runtime.job import Job
from ..runtime.output import encode
from ..runtime.pool import RankFailure
from ..runtime.progress import StepNote
from .errors import ApiError
from .metrics import Metrics
from .work import Work

logger = logging.getLogger(__name__)


class Running:
    """A batch run on its group and its requests answered (a failed group restarts by `Supervision._restart`)."""

    job: Job
    metrics: Metrics
    request_timeout_s: float
    running: int
    busy: set[int]
    active: set[Work]
    _encoding: set[asyncio.Task]

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
        ran = time.monotonic()
        seconds = ran - started
        at = 0
        for work in batch:
            work.ran = ran
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
        """Encode a finished request's pixels (its image format, or mp4) off the event loop and answer it; its
        group is free."""
        video = self.job.spec.video
        try:
            outputs = await asyncio.to_thread(lambda: [encode(pixels, video, *work.image_format)
                                                       for pixels in result["pixels"]])
            work.encoded = time.monotonic()
            work.finish({"outputs": outputs, "records": result["records"]})
        except Exception as err:  # noqa: BLE001 - an encoder failure fails this request only
            logger.exception("encoding the answer failed")
            work.fail(ApiError(500, f"encoding the answer failed: {type(err).__name__}", code="encode_failed"))
        finally:
            self.running -= 1


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


__all__ = ["Running", "stopped_error"]

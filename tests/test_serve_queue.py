"""The serve queue on its own (no server, no ranks): arrival order, the bound (429 with Retry-After), a request put
back at the head when its group must rebuild first, an idle wait that returns without closing, a deadline passed in
the queue (504), and close (503 for what waits)."""
from __future__ import annotations

import asyncio
import time

import pytest

from streamfusion_diffusers.serve.errors import ApiError
from streamfusion_diffusers.runtime.request import Request
from streamfusion_diffusers.serve.work import Work, WorkQueue


def _work(seed: int, deadline_s: float = 60.0) -> Work:
    params = Request("a cat", None, 64, 64, 1, 2, seed, None)
    return Work("image", params, deadline=time.monotonic() + deadline_s)


def test_order_bound_put_back_and_idle_wait():
    async def scenario() -> list:
        queue = WorkQueue(limit=2, groups=1, service_s=lambda: 3.0)
        first, second = _work(1), _work(2)
        await queue.put(first)
        await queue.put(second)
        with pytest.raises(ApiError) as full:
            await queue.put(_work(3))
        taken = await queue.take()
        await queue.put_back(taken)  # its group found a dead rank: the request waits at the head, not the tail
        again = await queue.take(0.05)
        rest = await queue.take(0.05)
        started = time.monotonic()
        idle = await queue.take(0.05)  # nothing came: None, and the queue is still open
        return [full.value, taken, again, rest, idle, time.monotonic() - started, queue.closed]

    full, taken, again, rest, idle, waited, closed = asyncio.run(scenario())
    assert full.status == 429 and full.headers["Retry-After"] == "9"  # 3 s x (2 waiting + 1) / 1 group
    assert taken.params.seed == 1 and again is taken and rest.params.seed == 2
    assert idle is None and 0.04 < waited < 1.0 and not closed


def test_a_deadline_passed_in_the_queue_is_504_and_close_answers_what_waits():
    async def scenario() -> list:
        queue = WorkQueue(limit=4, groups=1, service_s=lambda: 1.0)
        late, waiting = _work(1, deadline_s=-1.0), _work(2)
        await queue.put(late)
        got = await queue.take(0.05)  # the late one is answered, not returned
        await queue.put(waiting)
        await queue.close(ApiError(503, "stopping", code="unavailable"))
        with pytest.raises(ApiError) as refused:
            await queue.put(_work(3))
        return [got, late.done.exception(), waiting.done.exception(), refused.value, await queue.take(0.05)]

    got, late, waiting, refused, after = asyncio.run(scenario())
    assert got is None and late.status == 504 and waiting.status == 503
    assert refused.status == 503 and refused.code == "draining" and after is None

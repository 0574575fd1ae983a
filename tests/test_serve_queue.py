"""The serve queue on its own (no server, no ranks): arrival order, the bound (429 with Retry-After), a request put
back at the head when its group must rebuild first, an idle wait that returns without closing, a deadline passed in
the queue (504), and close (503 for what waits). Each scenario runs on a virtual clock, so its waits end exactly
when due however loaded the machine is."""
from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine
from typing import Any

import pytest

from streamfusion_diffusers.serve import work as work_module
from streamfusion_diffusers.serve.errors import ApiError
from streamfusion_diffusers.runtime.request import Request
from streamfusion_diffusers.serve.work import LINGER, Work, WorkQueue


class VirtualClock(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer whenever nothing is ready to run, or the timer is due
    within asyncio's clock resolution (which fires it that early): sleeps and timeouts take no wall time and fire
    in the order and at the times they were set for."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def _run_once(self) -> None:  # (asyncio's own step: ready callbacks, then the timers that are due)
        due = self._scheduled[0].when() if self._scheduled else None
        if due is not None and (not self._ready or due <= self.now + self._clock_resolution):
            self.now = max(self.now, due)
        super()._run_once()


@pytest.fixture
def run(monkeypatch) -> Any:
    """Run a scenario on a VirtualClock, the queue's time.monotonic() reading that clock."""
    monkeypatch.setattr(work_module, "time", types.SimpleNamespace(monotonic=lambda: now()))

    def running(scenario: Coroutine) -> Any:
        loop = VirtualClock()
        try:
            return loop.run_until_complete(scenario)
        finally:
            loop.close()

    return running


def now() -> float:
    return asyncio.get_running_loop().time()


def _work(seed: int, deadline_s: float = 60.0) -> Work:
    params = Request("a cat", None, 64, 64, 1, 2, seed, None)
    return Work("image", params, deadline=now() + deadline_s)


def test_order_bound_put_back_and_idle_wait(run):
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
        started = now()
        idle = await queue.take(0.05)  # nothing came: None after the wait, and the queue is still open
        return [full.value, taken, again, rest, idle, now() - started, queue.closed]

    full, taken, again, rest, idle, waited, closed = run(scenario())
    assert full.status == 429 and full.headers["Retry-After"] == "9"  # 3 s x (2 waiting + 1) / 1 group
    assert taken.params.seed == 1 and again is taken and rest.params.seed == 2
    assert idle is None and waited == pytest.approx(0.05) and not closed


def test_a_deadline_passed_in_the_queue_is_504_and_close_answers_what_waits(run):
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

    got, late, waiting, refused, after = run(scenario())
    assert got is None and late.status == 504 and waiting.status == 503
    assert refused.status == 503 and refused.code == "draining" and after is None


def test_gather_waits_for_the_last_batchs_companions_within_its_patience(run):
    """A burst joins within the short wait; companions that come later join only while fewer than the last batch's
    images are gathered and the patience lasts; requests of another shape keep their places."""
    async def scenario(expect: int, patience_s: float) -> tuple[list[int], float]:
        queue = WorkQueue(limit=8, groups=1, service_s=lambda: 1.0)
        other = _work(9)
        other.params = Request("a cat", None, 128, 128, 1, 2, 9, None)  # another shape
        for work in (_work(1), other, _work(2)):
            await queue.put(work)

        async def late() -> None:  # two companions, 0.15 s and 0.25 s after the batch began
            await asyncio.sleep(0.15)
            await queue.put(_work(3))
            await asyncio.sleep(0.1)
            await queue.put(_work(4))

        first = await queue.take()
        arrivals = asyncio.create_task(late())
        started = now()
        batch = await queue.gather(first, lambda w: (w.params.height, w.params.width), 8, 0.02, expect, patience_s)
        waited = now() - started
        await arrivals
        assert (await queue.take(0.01)) is other  # the other shape stayed first in line
        return [w.params.seed for w in batch], waited

    seeds, waited = run(scenario(expect=1, patience_s=1.0))  # no companions expected: the short wait
    assert seeds == [1, 2] and waited == pytest.approx(0.02)
    seeds, waited = run(scenario(expect=4, patience_s=1.0))  # the last batch had 4: wait for them, to the fourth
    assert seeds == [1, 2, 3, 4] and waited == pytest.approx(0.25)
    seeds, waited = run(scenario(expect=4, patience_s=0.2))  # patience ends before the fourth comes
    assert seeds == [1, 2, 3] and waited == pytest.approx(0.2)


def test_a_burst_spread_over_more_than_the_wait_is_one_batch_and_a_stream_is_cut(run):
    """Requests that keep coming within the wait of each other join one batch; a steady stream is cut LINGER x
    the wait after the first; a request that comes after a longer gap waits for the next batch."""
    async def scenario(gap_s: float, count: int) -> tuple[int, float]:
        queue = WorkQueue(limit=64, groups=1, service_s=lambda: 1.0)
        await queue.put(_work(0))

        async def stream() -> None:
            for seed in range(1, count):
                await asyncio.sleep(gap_s)
                await queue.put(_work(seed))

        first = await queue.take()
        arrivals = asyncio.create_task(stream())
        started = now()
        batch = await queue.gather(first, lambda w: (w.params.height, w.params.width), 64, 0.05)
        waited = now() - started
        arrivals.cancel()
        return len(batch), waited

    size, waited = run(scenario(gap_s=0.02, count=6))  # 0.1 s in all, 0.02 s apart: one batch, closed 0.05 s later
    assert size == 6 and waited == pytest.approx(0.15)
    size, _ = run(scenario(gap_s=0.1, count=3))  # the second comes after the window closed
    assert size == 1
    size, waited = run(scenario(gap_s=0.02, count=40))  # a stream: cut at LINGER x 0.05 s, 10 or 11 in by then
    assert size in (10, 11) and waited == pytest.approx(LINGER * 0.05)

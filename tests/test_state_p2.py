"""What a ParallelContext keeps (process groups, meshes, method "auto"'s choices, agreed shapes, the kernels'
choices and captured tables, the transport's watchdog) lives on it and is gone after shutdown(ctx): no module
global keeps the context alive, every live context is closed (what it was asked to release released), and two
contexts in one process never share a kernel choice; a context made with groups=ctx.groups reuses its process groups instead of creating its own (2 ranks)."""
from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.backends.watchdog import Watchdog
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.context import context_of
from streamfusion_diffusers.kernels import dispatch
from streamfusion_diffusers.kernels.state import current, owned_by


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


def _kept(ctx) -> dict[str, int]:
    return {"worlds": len(ctx.groups.worlds), "meshes": len(ctx.groups.meshes), "chosen": len(ctx.chosen),
            "agreed": len(ctx.agreed), "kernel times": len(ctx.kernels.times)}


def _choose(ctx, key: str, sdpa_ms: float, fused_ms: float) -> str:
    """The kernel chosen under ctx for `key`, given these times (a candidate's time is what its prepare returns:
    the real timer needs a GPU)."""
    timer, dispatch.time_ms = dispatch.time_ms, lambda prepare, run: prepare()
    try:
        with owned_by(ctx.kernels):
            return dispatch.choose(key, lambda: {"sdpa": (lambda: sdpa_ms, None),
                                                 "fused": (lambda: fused_ms, None)})
    finally:
        dispatch.time_ms = timer


def _run_then_shut_down() -> dict:
    ctx = init_parallel(ParallelConfig(method="auto"))
    other = init_parallel(ParallelConfig(method="ring"), groups=ctx.groups)
    x = torch.randn(1, 8, 4, 8)
    sp_attention(x, x, x, ctx)
    sp_attention(x, x, x, other)
    picks = (_choose(ctx, "shape", 1.0, 2.0), _choose(other, "shape", 2.0, 1.0))  # one key, opposite times
    before = _kept(ctx)
    shared = other.groups is ctx.groups
    alive, handle = weakref.ref(ctx), ctx.handle
    released: list[str] = []  # what holds work on the groups (CUDA graphs) lets go, the other context's too
    ctx.on_close(lambda: released.append("ctx"))
    other.on_close(lambda: released.append("other"))
    shutdown(ctx)
    after = _kept(ctx)
    try:
        context_of(handle)  # compiled code's way to the context: closed at once, though `ctx` is still held here
        reachable = True
    except RuntimeError:
        reachable = False
    del ctx, other
    gc.collect()
    return {"before": before, "after": after, "shared": shared, "picks": picks, "standalone": len(current().local),
            "alive": alive() is not None, "reachable": reachable, "released": sorted(released)}


def test_shutdown_empties_what_the_context_keeps(pool):
    for res in pool.run(_run_then_shut_down):
        assert res["shared"], res
        assert all(n > 0 for n in res["before"].values()), res
        assert all(n == 0 for n in res["after"].values()), res
        assert res["picks"] == ("sdpa", "fused") and res["standalone"] == 0, res  # each context its own choice
        assert not res["alive"] and not res["reachable"], res  # no module global keeps the context
        assert res["released"] == ["ctx", "other"], res  # every live context closed, each release run once


class _Event:
    """A CUDA event's query() on the CPU: complete once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_the_watchdog_thread_runs_while_something_is_pending_and_a_little_after():
    watchdog, event = Watchdog(poll_s=0.01, idle_s=1.0), _Event()
    watchdog.watch(event, "a transfer", time.monotonic(), 60.0)
    thread = watchdog._thread
    assert thread is not None and thread.is_alive()
    event.done = True
    time.sleep(0.1)
    later = _Event()
    later.done = True
    watchdog.watch(later, "the next layer's transfer", time.monotonic(), 60.0)
    assert watchdog._thread is thread and thread.is_alive()  # one thread for transfers that follow each other
    thread.join(timeout=5)
    assert not thread.is_alive() and watchdog._thread is None  # nothing pending: the thread ended
    watchdog.watch(_Event(), "another transfer", time.monotonic(), 60.0)  # pending until close()
    thread = watchdog._thread
    watchdog.close()
    assert not thread.is_alive() and watchdog._thread is None

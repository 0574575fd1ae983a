"""The runtime's batches on 4 gloo ranks: a request's images in a batch are its images alone (same seeds, same
pixels) for an image family with padded prompts (Flux) and one with unpadded prompts (Qwen-Image); videos run one
per call; a cancel stops a running call on every rank at the same step and the ranks take the next call."""
from __future__ import annotations

import argparse
import gc
import threading
import time

import numpy as np
import pytest

from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.batch import batch_key, call_plan, unbatched_why
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.runtime.request import Request

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _job(model: str, *argv: str):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return generate.make_job(parser.parse_args(["--model", model, "--steps", "2", *argv]))


def _request(prompt: str, seed: int, n: int = 1, frames: int = 1, steps: int = 2, size: int = 48) -> Request:
    return Request(prompt, None, 32, size, frames, steps, seed, None, n=n)


def _pixels(answer: dict) -> list[np.ndarray]:
    return [np.stack([np.asarray(f) for f in p]) if isinstance(p, list) else np.asarray(p) for p in answer["pixels"]]


def test_call_plan_encodes_each_prompt_once_and_puts_images_back_in_request_order():
    plan = call_plan([_request("a", 5), _request("b", 9), _request("a", 1)])  # counts a: 2, b: 1 -> per image
    assert plan.prompt == ["a", "b", "a"] and plan.per_prompt == 1 and plan.seeds == [5, 9, 1]
    plan = call_plan([_request("a", 5, n=2), _request("b", 9), _request("b", 3)])
    assert plan.prompt == ["a", "b"] and plan.per_prompt == 2 and plan.seeds == [5, 6, 9, 3]
    plan = call_plan([_request("a", 5), _request("b", 9), _request("a", 1), _request("b", 2)])
    assert plan.prompt == ["a", "b"] and plan.seeds == [5, 1, 9, 2] and plan.order == [0, 2, 1, 3]
    assert plan.unshuffle(["a5", "a1", "b9", "b2"]) == ["a5", "b9", "a1", "b2"]


@pytest.mark.parametrize("model, frames, size", [("tiny-flux", 1, 48), ("tiny-qwen-image", 1, 48)])
def test_batched_images_are_the_single_requests_images(pool, model, frames, size):
    job = _job(model)
    pool.run(worker.build, job)
    prompts = ["a lighthouse at dawn", "a red fox in the snow"]
    if batch_key(job, _request(prompts[0], 0)) != batch_key(job, _request(prompts[1], 0)):
        prompts = prompts[:1]  # unpadded prompt tokens: one prompt per batch
    batch = [_request(prompts[0], 3, n=2, frames=frames, size=size),
             _request(prompts[-1], 11, frames=frames, size=size), _request(prompts[0], 40, frames=frames, size=size)]
    batched = pool.run(worker.run, batch)[0]
    assert [r["seed"] for r in batched["records"]] == [3, 4, 11, 40]
    assert {r["batch"] for r in batched["records"]} == {4}
    singles = [p for r in batch for i in range(r.n)
               for p in _pixels(pool.run(worker.run, [_request(r.prompt, r.seed + i, frames=frames, size=size)])[0])]
    together = _pixels(batched)
    assert [p.shape for p in together] == [p.shape for p in singles]
    for one, alone in zip(together, singles):
        assert np.array_equal(one, alone), f"{model}: up to {np.abs(one.astype(int) - alone).max()} apart"
    assert not np.array_equal(together[0], together[1])  # seeds 3 and 4


def test_videos_run_one_per_call():
    assert "not yet" in unbatched_why(_job("tiny-wan"))
    assert unbatched_why(_job("tiny-flux")) is None


def test_a_cancel_stops_every_rank_at_one_step_and_the_next_call_runs(pool):
    job = _job("tiny-flux")
    pool.run(worker.build, job)
    call = pool.calls + 1
    noted = threading.Event()

    def cancel_once_running() -> None:
        while pool.last_note is None:
            time.sleep(0.01)
        noted.set()
        pool.cancel(call)

    threading.Thread(target=cancel_once_running, daemon=True).start()
    answer = pool.run(worker.run, [_request("a", 1, steps=200)])
    assert noted.is_set()
    assert answer[0]["stopped"] == "cancelled" and answer[0]["step"] < 20, answer[0]
    assert answer[1:] == [None] * (WORLD - 1)
    after = pool.run(worker.run, [_request("a", 1)])[0]  # the old cancel does not stop the next call
    assert len(after["pixels"]) == 1 and after["records"][0]["request_id"]


def test_a_built_rank_keeps_its_pipeline_out_of_the_collectors_full_passes(pool):
    pool.run(worker.build, _job("tiny-flux"))
    assert all(frozen > 10_000 for frozen in pool.run(gc.get_freeze_count))

"""`streamfusion serve` when things go wrong: a rank killed mid-request (5xx within seconds, /health 503, the
group restarted and rebuilt, the queue served again), a rank killed between requests (the group rebuilt before
the next one runs) and SIGTERM (new requests 503, the one in flight finishes,
exit 0, no process left). One server, in this order. Then each on a server of its own: a rank out of memory,
SIGTERM during start-up, a build past --build-timeout, a drain past --drain-timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from serve_cases import ROOT, Server
from streamfusion_diffusers.serve.supervisor import restart_wait

# a killed rank's request is answered within this (the pool polls every 0.5 s, then 5 s of grace), with room for a
# loaded machine: still far below its --request-timeout (600 s), which it would wait for unseen
FAULT_S = 60.0


@pytest.fixture(scope="module")
def server():
    with Server("--model", "tiny-flux", "--max-steps", "2000") as s:
        yield s


def _generate(url: str, out: dict, **fields) -> None:
    started = time.monotonic()
    answer = httpx.post(url + "/v1/images/generations", json={"prompt": "a", **fields}, timeout=300)
    out.update(status=answer.status_code, body=answer.json(), seconds=time.monotonic() - started)


def _wait_for_steps(url: str) -> None:
    """Until the running request has made a step (so the kill lands mid-request, not mid-build)."""
    ends = time.monotonic() + 60
    while time.monotonic() < ends and httpx.get(url + "/health").json()["running"] == 0:
        time.sleep(0.1)
    time.sleep(1.0)


def test_a_killed_rank_fails_its_request_within_seconds_then_the_group_is_rebuilt(server):
    answer: dict = {}
    victim = server.rank_pids()[2]
    running = threading.Thread(target=_generate, args=(server.url, answer), kwargs={"num_inference_steps": 2000})
    running.start()
    _wait_for_steps(server.url)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    running.join(timeout=120)
    assert answer["status"] == 500, answer
    error = answer["body"]["error"]
    assert error["code"] == "rank_failed" and "rank 2" in error["message"] and "SIGKILL" in error["message"]
    assert time.monotonic() - killed < FAULT_S
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "recovering"
    ends = time.monotonic() + 240
    while httpx.get(server.url + "/health").status_code != 200:
        assert time.monotonic() < ends, "the group was not rebuilt"
        time.sleep(0.5)
    assert victim not in server.rank_pids()
    while "group 0: back after" not in server.stderr:  # said once ready, on stderr (read by a thread of its own)
        assert time.monotonic() < ends, server.stderr
        time.sleep(0.1)
    after: dict = {}
    _generate(server.url, after, seed=1)
    assert after["status"] == 200
    assert "streamfusion_restarts_total 1" in httpx.get(server.url + "/metrics").text


def test_a_rank_killed_between_requests_restarts_its_group_before_the_next_one(server):
    """No request is sent to a group with a dead rank: the supervisor sees the death while idle and rebuilds."""
    victim = server.rank_pids()[1]
    os.kill(victim, signal.SIGKILL)
    ends = time.monotonic() + FAULT_S
    while httpx.get(server.url + "/health").status_code == 200:
        assert time.monotonic() < ends, "the dead rank of an idle group went unseen"
        time.sleep(0.1)
    answer: dict = {}
    _generate(server.url, answer, seed=2)  # queued while the group rebuilds, run after
    assert answer["status"] == 200, answer
    assert "streamfusion_restarts_total 2" in httpx.get(server.url + "/metrics").text


def test_sigterm_refuses_new_requests_finishes_the_one_in_flight_and_exits_0(server):
    answer: dict = {}
    running = threading.Thread(target=_generate, args=(server.url, answer), kwargs={"num_inference_steps": 60})
    running.start()
    _wait_for_steps(server.url)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(server.url + "/v1/images/generations", json={"prompt": "b"}, timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert httpx.get(server.url + "/health").status_code == 503
    running.join(timeout=120)
    assert answer["status"] == 200, answer
    assert server.proc.wait(timeout=60) == 0, server.stderr
    time.sleep(0.5)
    assert server.left() == [], "processes left after exit"
    assert "leaked semaphore" not in server.stderr, server.stderr  # ranks stopped by force hold none


def test_an_out_of_memory_rank_fails_its_request_with_503_and_the_group_serves_on():
    """One rank runs out of memory at step 4 (injected): every rank leaves the call together, the request gets
    503, and the next request runs on the same ranks (no restart)."""
    with Server("--model", "tiny-flux", env={"STREAMFUSION_TEST_OOM_AT_STEP": "4"}) as server:
        pids = server.rank_pids()
        answer: dict = {}
        _generate(server.url, answer, num_inference_steps=6)
        assert answer["status"] == 503, answer
        error = answer["body"]["error"]
        assert error["code"] == "out_of_memory" and "after step 4 of 6" in error["message"], error
        after: dict = {}
        _generate(server.url, after, num_inference_steps=3)
        assert after["status"] == 200, after
        assert server.rank_pids() == pids
        assert "streamfusion_restarts_total 0" in httpx.get(server.url + "/metrics").text


def test_restarts_are_rate_limited():
    assert restart_wait([0.0, 1.0, 2.0], now=2.0, burst=3, window_s=60.0) == 0.0
    assert restart_wait([0.0, 1.0, 2.0, 3.0], now=3.0, burst=3, window_s=60.0) == 57.0
    assert restart_wait([0.0, 1.0, 2.0, 70.0], now=70.0, burst=3, window_s=60.0) == 0.0


def _starting(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """A serve process being started (not waited for), and its stderr lines as they come."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "streamfusion_diffusers", "serve", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


def test_sigterm_during_start_up_exits_before_the_start_ends():
    proc, lines = _starting("--model", "tiny-flux")
    ends = time.monotonic() + 120
    while len(ranks := psutil.Process(proc.pid).children(recursive=True)) < 4:  # spawned: now starting
        assert time.monotonic() < ends and proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 0, (code, "".join(lines))
    # the build was cut short, not waited for (a start that ran on would say these before the exit)
    assert not any(said in line for line in lines for said in ("pipeline built", "warm-up done")), "".join(lines)
    time.sleep(0.5)
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in "".join(lines)


def test_a_start_past_build_timeout_fails_with_one_line():
    proc, lines = _starting("--model", "tiny-flux", "--build-timeout", "0.5")
    assert proc.wait(timeout=120) == 2  # a configuration to change, as a bad option
    time.sleep(0.2)
    said = [line for line in lines if "--build-timeout" in line]
    assert len(said) == 1 and "group 0: its start took longer than --build-timeout 0.5 s" in said[0], lines
    assert "Traceback" not in "".join(lines)


def test_a_drain_past_drain_timeout_answers_503_and_exits():
    with Server("--model", "tiny-flux", "--max-steps", "2000", "--drain-timeout", "1") as server:
        stages = ("rank(s) started", "group 0: pipeline built", "group 0: warm-up done")
        ends = time.monotonic() + 10  # said before the ready line, on stderr (read by a thread of its own)
        while not all(stage in server.stderr for stage in stages):
            assert time.monotonic() < ends, server.stderr
            time.sleep(0.1)
        answer: dict = {}
        running = threading.Thread(target=_generate, args=(server.url, answer), kwargs={"num_inference_steps": 2000})
        running.start()
        _wait_for_steps(server.url)
        server.proc.send_signal(signal.SIGTERM)
        running.join(timeout=60)
        assert answer["status"] == 503, answer
        assert answer["body"]["error"]["code"] == "unavailable" and "--drain-timeout 1" in answer["body"]["error"][
            "message"]
        assert server.proc.wait(timeout=60) == 0, server.stderr  # (its 2000 steps would take minutes more)


def test_a_supervisor_that_fails_after_its_batch_started_answers_it_and_restarts_its_group(monkeypatch):
    """Ranks that answer a batch without its pixels (a KeyError in the supervisor, after the batch started): every
    request of it is answered 500 at once, the group is restarted as after a dead rank and serves again, and a
    drain does not wait for requests that no longer run. In-process, on a group of no ranks."""
    import argparse
    import asyncio

    from streamfusion_diffusers.runtime.group import Group
    from streamfusion_diffusers.serve import service as service_module
    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.limits import limits
    from streamfusion_diffusers.serve.protocol import ImageRequest

    class MalformedGroup(Group):
        """No ranks: it starts at once, and answers every batch without its pixels."""

        def start(self, *_: object) -> dict:
            self.info = {"record": {"layout": "none", "backend": "none"}}
            return self.info

        def run(self, *_: object) -> dict:
            time.sleep(0.2)
            return {"records": []}

        def dead(self) -> dict:
            return {}

        def stop(self, now: bool = False) -> None:
            pass

    monkeypatch.setattr(service_module, "Group", MalformedGroup)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-flux", "--cpu"])
    job, devices = serve_job(args)
    exits: list[int] = []

    async def no_one_left() -> bool:
        return False

    async def run() -> tuple[list, dict]:
        service = service_module.Service(job, limits(args, job), devices, 4, 60.0, lambda _: None, exits.append)
        await service.start()
        while service.health()[0] != 200:
            await asyncio.sleep(0.01)
        params = [service.checker.image(ImageRequest(prompt="a", seed=seed)) for seed in range(2)]
        works = [await service.submit("image", p) for p in params]
        answers = await asyncio.wait_for(asyncio.gather(*(service.wait(w, no_one_left) for w in works),
                                                        return_exceptions=True), 10)
        while service.health()[0] != 200:
            await asyncio.sleep(0.01)
        health = service.health()[1]
        await asyncio.wait_for(service.drain(), 5)
        await service.close()
        return answers, health

    answers, health = asyncio.run(run())
    assert all(isinstance(a, ApiError) and a.status == 500 and "KeyError" in a.message for a in answers), answers
    assert health["groups"][0]["restarts"] >= 1 and health["running"] == 0, health
    assert exits == [0]

"""`streamfusion serve` across machines, as 2 emulated nodes on one machine: two `streamfusion launch` launchers
on 127.0.0.1 (gloo, 2 processes each, tiny-flux), talked to with the official openai client and httpx.

One group spanning both nodes, their link emulated, answers what `generate` gives on the same 4 ranks, layout and
link, and its request pays the link for what it sent across. With one group per node, node 1 stalled (SIGSTOP)
and then killed (SIGKILL of its launcher) each fail the request its group runs within 10 s while node 0's group
serves on; node 1 resumed (SIGCONT), and later its launcher started again, bring its group back."""
from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import numpy as np
import openai
import psutil
from PIL import Image

from serve_cases import READY, ROOT, START_S
from streamfusion_diffusers.core.links import parse_link
from streamfusion_diffusers.runtime.pool import free_port

PROMPT = "a lighthouse on a cliff at dawn"
FAIL_S = 60.0  # a killed node's request is answered 5xx within this: a loaded machine's room, far below the 600 s
# --request-timeout it would wait for unseen
BACK_S = 300.0  # a restarted node's group is back within this (start-up and build on a loaded machine)
LINK = "1:100000"  # between the emulated nodes: 100 ms a message, so what a request pays stands out of the noise


class Nodes:
    """Two launchers (`streamfusion launch --nnodes 2 --nproc-per-node 2`) serving ARGS; node 0's URL once ready."""

    def __init__(self, *args: str):
        self.args, self.master_port, self.join_port = args, free_port(), free_port()
        self.launchers: dict[int, subprocess.Popen] = {}
        self.err: list[str] = []
        self.start(1)
        self.start(0)
        self.url = ""
        ends = time.monotonic() + START_S
        for line in self.launchers[0].stdout:
            if found := READY.match(line.strip()):
                self.url = found[2]
                break
            if time.monotonic() > ends:
                break
        if not self.url:
            self.close()
            raise RuntimeError("the two launchers did not get ready:\n" + "".join(self.err))

    def start(self, node: int) -> None:
        """Start (or start again) node `node`'s launcher."""
        command = [sys.executable, "-m", "streamfusion_diffusers", "launch", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(self.master_port),
                   "-m", "streamfusion_diffusers", "serve", "--model", "tiny-flux", "--port", "0", "--join-port",
                   str(self.join_port), *self.args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAMFUSION_QUIET": "1",
               "STREAMFUSION_JOIN_KEY": "the-job-secret-both-launchers-share"}  # the join handshake proves it
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        threading.Thread(target=lambda: self.err.extend(proc.stderr), daemon=True).start()
        self.launchers[node] = proc

    def family(self, *nodes: int) -> list[psutil.Process]:
        """Every process of these nodes' launchers now (default both; the launched ones are in sessions of their
        own)."""
        found = []
        for node in nodes or self.launchers:
            try:
                launcher = psutil.Process(self.launchers[node].pid)
                found += [launcher, *launcher.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return found

    def signal(self, node: int, sig: int) -> None:
        """Send `sig` to every process of the node's launcher: the launcher, its host and the host's ranks."""
        for proc in self.family(node):
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        left = self.family()
        for proc in left:  # a stalled node hears no SIGTERM
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        for proc in self.launchers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.launchers.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for proc in left:  # what a launcher killed left behind ends by itself within seconds; never leave it
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def generate(steps: int, size: str = "64x64") -> dict:
    return {"prompt": PROMPT, "size": size, "num_inference_steps": steps, "response_format": "b64_json"}


@pytest.mark.slow  # the default run keeps the node fault test; both start two launchers and a group across them
def test_a_request_on_a_group_across_both_nodes_equals_generate_on_the_same_ranks_and_pays_the_link(tmp_path):
    seed = 7
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", "tiny-flux", "--prompt",
                    PROMPT, "--seed", str(seed), "--emulate-link", LINK, "--output", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    generated = np.asarray(Image.open(tmp_path / "image.png"))
    run = json.loads((tmp_path / "run.json").read_text())
    with Nodes("--emulate-link", LINK) as nodes:
        health = nodes.health()
        assert [g["nodes"] for g in health["groups"]] == [[0, 1]] and health["status"] == "ready"
        client = openai.OpenAI(api_key="none", base_url=nodes.url + "/v1", max_retries=0)
        answer = client.images.generate(model="tiny-flux", prompt=PROMPT, response_format="b64_json",
                                        extra_body={"seed": seed})
    served = png(answer.data[0].b64_json)
    assert served.shape == generated.shape
    assert np.array_equal(served, generated)
    ran = answer.model_extra["streamfusion"]["runs"][0]
    assert ran["layout"] == run["layout"] == "usp 2x2 U2R2"
    assert ran["config"]["machines"] == run["config"]["machines"] == 2
    assert ran["config"]["emulate_link"] == run["config"]["emulate_link"] == LINK
    # the same call sends the same across the link; rank 0's sends are booked one after another on its emulated
    # NIC within the call, so the call took at least the link's time for them (here over a second)
    crossed = ran["crossed"]
    assert crossed == run["crossed"] and crossed["sent_bytes"] > 0
    paid = parse_link(LINK).seconds(crossed["sent_bytes"], crossed["sent_messages"])
    assert ran["generate_s"] >= paid > 1.0, (ran["generate_s"], crossed)


def fail_node_1(nodes: Nodes, act: Callable[[], None]) -> tuple[httpx.Response, httpx.Response]:
    """A long request on each group, `act` (node 1 stalled or killed) while both run: (the 5xx of node 1's group,
    which must come within FAIL_S, and node 0's group's answer)."""
    long = {"prompt": PROMPT, "size": "128x128", "num_inference_steps": 100}  # runs while node 1 is lost
    with ThreadPoolExecutor(2) as pool:  # one on each group
        answers = [pool.submit(httpx.post, nodes.url + "/v1/images/generations", json=long, timeout=600)
                   for _ in range(2)]
        ends = time.monotonic() + 120
        while {g["state"] for g in nodes.health()["groups"]} != {"busy"}:
            assert time.monotonic() < ends, nodes.health()
            time.sleep(0.2)
        act()
        acted = time.monotonic()
        failed = None
        while failed is None:
            assert time.monotonic() - acted < FAIL_S, f"no 5xx within {FAIL_S:g} s of losing node 1"
            failed = next((a.result() for a in answers if a.done() and a.result().status_code >= 500), None)
            time.sleep(0.05)
        assert "parallel group 1" in failed.json()["error"]["message"]
        served = next(a.result() for a in answers if a.result() is not failed)
    return failed, served


def check_node_0_serves(nodes: Nodes, served: httpx.Response) -> None:
    """Node 0's group answered its request, and serves the next, while node 1's waits for its node."""
    assert served.status_code == 200 and served.json()["streamfusion"]["group"] == 0
    health = nodes.health()
    assert health["status"] == "ready"
    assert [g["state"] for g in health["groups"]] == ["ready", "waiting for a node"]
    quick = httpx.post(nodes.url + "/v1/images/generations", json=generate(2), timeout=120)
    assert quick.status_code == 200 and quick.json()["streamfusion"]["group"] == 0


def wait_both_ready(nodes: Nodes) -> None:
    ends = time.monotonic() + BACK_S
    while [g["state"] for g in nodes.health()["groups"]] != ["ready", "ready"]:
        assert time.monotonic() < ends, nodes.health()
        time.sleep(1.0)


def test_a_stalled_or_killed_node_fails_its_group_fast_node_0_serves_on_and_its_group_comes_back():
    # one request a call: two that arrive together would otherwise share one group's call, leaving the other idle
    with Nodes("--replicas", "2", "--max-batch", "1") as nodes:
        assert [g["nodes"] for g in nodes.health()["groups"]] == [[0], [1]]
        failed, served = fail_node_1(nodes, lambda: nodes.signal(1, signal.SIGSTOP))
        assert "stalled" in failed.json()["error"]["message"]
        check_node_0_serves(nodes, served)
        nodes.signal(1, signal.SIGCONT)  # its host beats again: the group starts new ranks there
        wait_both_ready(nodes)

        # both groups busy again: node 1's serves after its stall
        failed, served = fail_node_1(nodes, lambda: nodes.launchers[1].send_signal(signal.SIGKILL))
        check_node_0_serves(nodes, served)
        nodes.start(1)
        wait_both_ready(nodes)
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: httpx.post(nodes.url + "/v1/images/generations", json=generate(40),
                                                      timeout=300), range(2)))
        assert [b.status_code for b in both] == [200, 200]
        assert sorted(b.json()["streamfusion"]["group"] for b in both) == [0, 1]

"""`streamfusion serve` across machines, as 2 emulated nodes on one machine: two `streamfusion launch` launchers
on 127.0.0.1 (gloo, 2 processes each, tiny-flux), talked to with the official openai client and httpx.

One group spanning both nodes answers what `generate` gives on the same 4 ranks and layout; with one group per
node, SIGKILL of node 1's launcher fails the request its group runs within 10 s while node 0's group serves on,
and node 1's launcher started again brings its group back."""
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
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import psutil
from PIL import Image

from serve_cases import READY, ROOT, START_S
from streamfusion_diffusers.runtime.pool import free_port

PROMPT = "a lighthouse on a cliff at dawn"
FAIL_S = 10.0  # a killed node's request is answered 5xx within this
BACK_S = 300.0  # a restarted node's group is back within this (start-up and build on a loaded machine)


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
        env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAMFUSION_QUIET": "1"}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        threading.Thread(target=lambda: self.err.extend(proc.stderr), daemon=True).start()
        self.launchers[node] = proc

    def family(self) -> list[psutil.Process]:
        """Every process of both launchers now (the launched ones are in sessions of their own)."""
        found = []
        for proc in self.launchers.values():
            try:
                found += [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return found

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def close(self) -> None:
        left = self.family()
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


def test_a_request_on_a_group_across_both_nodes_equals_generate_on_the_same_ranks(tmp_path):
    seed = 7
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", "tiny-flux", "--prompt",
                    PROMPT, "--seed", str(seed), "--output", str(tmp_path)], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    generated = np.asarray(Image.open(tmp_path / "image.png"))
    run = json.loads((tmp_path / "run.json").read_text())
    with Nodes() as nodes:
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


def test_a_killed_node_fails_its_group_fast_node_0_serves_on_and_its_restart_brings_it_back():
    with Nodes("--replicas", "2") as nodes:
        assert [g["nodes"] for g in nodes.health()["groups"]] == [[0], [1]]
        long = {"prompt": PROMPT, "size": "128x128", "num_inference_steps": 100}  # runs while node 1 is killed
        with ThreadPoolExecutor(2) as pool:  # one on each group
            answers = [pool.submit(httpx.post, nodes.url + "/v1/images/generations", json=long, timeout=600)
                       for _ in range(2)]
            ends = time.monotonic() + 120
            while {g["state"] for g in nodes.health()["groups"]} != {"busy"}:
                assert time.monotonic() < ends, nodes.health()
                time.sleep(0.2)
            nodes.launchers[1].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            failed = None
            while failed is None:
                assert time.monotonic() - killed < FAIL_S, "no 5xx within 10 s of the kill"
                failed = next((a.result() for a in answers if a.done() and a.result().status_code >= 500), None)
                time.sleep(0.05)
            assert "parallel group 1" in failed.json()["error"]["message"]
            served = [a.result() for a in answers if a.result() is not failed]
        assert served[0].status_code == 200 and served[0].json()["streamfusion"]["group"] == 0
        health = nodes.health()
        assert health["status"] == "ready"
        assert [g["state"] for g in health["groups"]] == ["ready", "waiting for a node"]
        quick = httpx.post(nodes.url + "/v1/images/generations", json=generate(2), timeout=120)
        assert quick.status_code == 200 and quick.json()["streamfusion"]["group"] == 0

        nodes.start(1)
        ends = time.monotonic() + BACK_S
        while [g["state"] for g in nodes.health()["groups"]] != ["ready", "ready"]:
            assert time.monotonic() < ends, nodes.health()
            time.sleep(1.0)
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda _: httpx.post(nodes.url + "/v1/images/generations", json=generate(40),
                                                      timeout=300), range(2)))
        assert [b.status_code for b in both] == [200, 200]
        assert sorted(b.json()["streamfusion"]["group"] for b in both) == [0, 1]

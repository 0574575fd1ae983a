"""`streamfusion bench --level e2e` with its GPU baselines on 2 GPUs, tiny models (about a minute): diffusers'
context parallelism on Flux and xfuser's CogVideoX pipeline (with and without its CFG split) run beside ours and
one GPU, and every output matches the one-GPU pipeline's. Skipped without 2 GPUs and xfuser."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("xfuser") is None, reason="needs xfuser (pip install -e '.[xdit]')"),
]


def test_e2e_baselines_run_and_match_one_gpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "streamfusion_diffusers", "bench", "--level", "e2e", "--model-size", "tiny",
                           "--workloads", "flux-dev:64,cogvideox-5b:9:64:64", "--steps", "2", "--iters", "1",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    cases = {(r["workload"].split()[0], r["case"]) for r in rows}
    assert {("flux-dev", "diffusers-cp U2R1"), ("flux-dev", "diffusers-cp U1R2"), ("cogvideox-5b", "xfuser cfg2 U1R1"),
            ("cogvideox-5b", "xfuser U2R1"), ("cogvideox-5b", "ours-cfg")} <= cases, cases
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]

"""On 4 GPUs, NCCL: `bench` over emulated machines (2 x 2 and 4 x 1, p4de) finishes every method and layout of
one attention layer, exact, within its --timeout (it hung when the emulated link's bookings were released by a
Python thread, which a main thread blocked with the GIL held starved; the copy engines hold them now)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
OUT = os.environ.get("OUT", "/tmp")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
@pytest.mark.parametrize("machines", [2, 4])
def test_bench_over_emulated_machines_finishes_on_nccl(machines):
    out = os.path.join(OUT, f"bench-emulated-{machines}x{4 // machines}")
    cmd = [sys.executable, "-m", "streamfusion_diffusers", "launch", "--nproc-per-node", "4", "-m",
           "streamfusion_diffusers", "bench", "--workloads", "flux-dev:2048", "--level", "layer", "--machines",
           str(machines), "--emulate-link", "p4de", "--methods", "ulysses,ring,usp,tas,torus", "--layouts", "all",
           "--backend", "torch", "--iters", "3", "--warmup", "3", "--timeout", "120", "--out", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=580, env=env)
    log = done.stdout + done.stderr
    with open(f"{out}.log", "w") as f:
        f.write(log)
    assert done.returncode == 0, log[-6000:]
    assert "MISMATCH" not in log and "nothing finished" not in log, log[-6000:]
    assert "torus U2R2T2" in log if machines == 2 else "torus U4R1T4" in log, log[-6000:]

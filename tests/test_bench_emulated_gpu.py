"""On 4 GPUs, NCCL: `bench` over emulated machines (2 x 2 and 4 x 1, p4de) finishes every method and layout of
one attention layer, exact, within its --timeout (it hung at its first timed rounds: the emulated link's
bookings are released by a Python thread, which a main thread blocked with the GIL held starved). One GPU:
the host never posts more than MAX_UNRELEASED bookings ahead of their release."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

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


@pytest.mark.skipif(importlib.util.find_spec("cuda") is None, reason="needs cuda-bindings")
@pytest.mark.skipif(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", reason="sleep-kernel bookings")
def test_the_host_stays_within_max_unreleased_bookings():
    from streamfusion_diffusers.backends.emulated import _gpu_queues
    from streamfusion_diffusers.backends.gpu_delay import MAX_UNRELEASED

    send, _ = _gpu_queues(torch.cuda.current_device())
    nic = send.nic
    assert nic is not None
    torch.cuda._sleep(int(1e8))  # the GPU busy: no booking can start yet
    start, most = time.perf_counter(), 0
    for _ in range(3 * MAX_UNRELEASED):
        nic.book(2e-3)
        most = max(most, nic.pending())
    posted_s = time.perf_counter() - start
    torch.cuda.synchronize()
    assert most <= MAX_UNRELEASED, most
    assert posted_s >= 2 * MAX_UNRELEASED * 2e-3 * 0.9, posted_s  # the host waited for releases

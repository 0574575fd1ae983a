"""The GPU side of bounded waits, on one GPU: a layer whose stream never drains in time makes the next
begin_layer raise TransferFailed naming the layer (80 % of timeout_s), and the watchdog thread then ends the
process, named, with exit code 70 (90 %) while the host is stuck in a synchronize. Needs a CUDA GPU."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STUCK_LAYERS = textwrap.dedent("""
    import time, torch
    from streamfusion_diffusers.backends import TorchTransport
    from streamfusion_diffusers.backends.watch import TransferFailed, WatchedTransport
    from streamfusion_diffusers.core.mesh import Group

    transport = WatchedTransport(TorchTransport(), 2.0)
    alone = Group((0,), 0, None, "ulysses_intra")
    x = torch.randn(64, device="cuda")
    start = time.monotonic()
    try:
        for _ in range(20):
            transport.begin_layer(0)
            transport.all_to_all([[x]], [[torch.empty_like(x)]], alone).wait()  # a CUDA transfer: watched
            torch.cuda._sleep(int(5e10))  # then the layer takes far longer than timeout_s
            transport.end_layer()
    except TransferFailed as err:
        print(f"RAISED after {time.monotonic() - start:.2f} s: {err}", flush=True)
    torch.cuda.synchronize()  # stuck: the watchdog thread must end the process
    print("NOT ENDED", flush=True)
""")


def test_a_stuck_layer_raises_then_the_watchdog_ends_the_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", STUCK_LAYERS], capture_output=True, text=True, timeout=60, env=env)
    assert "RAISED after" in done.stdout and "attention layer 1" in done.stdout, (done.stdout, done.stderr)
    seconds = float(done.stdout.split("RAISED after ")[1].split(" s")[0])
    assert 1.4 <= seconds <= 2.0, done.stdout
    assert "NOT ENDED" not in done.stdout and done.returncode == 70, (done.returncode, done.stdout, done.stderr)
    assert "did not complete within 2 s" in done.stderr, done.stderr

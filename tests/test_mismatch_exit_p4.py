"""One rank of 4 (gloo, under torchrun) passes a different slice length: every method names the problem on
every rank, and the script ends with that error on every rank, not an abort (`terminate called`) at exit."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from streamfusion_diffusers.core.config import METHODS

WORLD = 4
JOB = Path(__file__).with_name("mismatch_job.py")


def test_an_odd_slice_is_named_on_every_rank_and_the_job_ends_cleanly():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                           str(JOB)], capture_output=True, text=True, timeout=600, env=env)
    out = done.stdout + done.stderr
    assert "terminate called" not in out and "exitcode: -6" not in out, out[-3000:]
    for rank in range(WORLD):
        for method in METHODS:
            said = f"rank {rank} {method}: sp_attention inputs differ between ranks: slice lengths differ (8 on " \
                   f"ranks [0, 1, 3], 9 on rank [2])"  # searched, not per line: the ranks' prints interleave
            assert said in done.stdout, (rank, method, out[-3000:])
    assert done.returncode == 1, out[-3000:]

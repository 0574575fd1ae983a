"""The symm-pull transport (backends/symm_pull.py) off GPUs: its pull kernel, run in Triton's CPU interpreter,
puts piece `me` of every member's buffer into slot j of the output (odd sizes, a partial last block, two dtypes);
asked for where it cannot run, it says why once and the torch transport runs, or it raises when strict. On GPUs:
tests/test_symm_pull_gpu.py and tests/test_graphs.py."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from streamfusion_diffusers.backends import TorchTransport, make_transport

_PULL = """
import torch
from streamfusion_diffusers.backends.symm_pull import BLOCK_BYTES, pull
for dtype, members, piece in ((torch.bfloat16, 4, 3 * BLOCK_BYTES // 2 + 6), (torch.float32, 3, 5)):
    g = torch.Generator().manual_seed(members)
    buffers = [torch.randn(members * piece, generator=g).to(dtype) for _ in range(members)]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    for me in range(members):
        out = torch.zeros(members * piece, dtype=dtype)
        pull(ptrs, out.view(torch.uint8), me, members)
        expected = torch.cat([b[me * piece:(me + 1) * piece] for b in buffers])
        assert torch.equal(out, expected), (dtype, members, me)
print("pulled")
"""


def test_the_pull_kernel_takes_this_ranks_piece_of_every_member_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _PULL], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "pulled" in run.stdout, run.stderr[-3000:]


def test_symm_pull_where_it_cannot_run_says_why_once_and_runs_the_torch_transport(caplog):
    from streamfusion_diffusers.core.logs import forget_said

    forget_said()
    with caplog.at_level(logging.WARNING):
        transports = [make_transport("symm-pull"), make_transport("symm-pull")]
    assert all(type(t) is TorchTransport for t in transports)
    said = [r.getMessage() for r in caplog.records if "'symm-pull' cannot run" in r.getMessage()]
    assert len(said) == 1 and "does not run NCCL on GPUs" in said[0], said


def test_symm_pull_asked_strictly_says_why_it_cannot_run():
    with pytest.raises(ValueError, match="backend 'symm-pull' cannot run: the job does not run NCCL on GPUs"):
        make_transport("symm-pull", strict=True)

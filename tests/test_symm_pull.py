"""The symm-pull transport (backends/symm_pull.py) off GPUs: its pull kernel, run in Triton's CPU interpreter,
puts piece `me` of every member's buffer into slot j of the output (odd sizes, a partial last block, two dtypes);
Ulysses packs its sends into the buffer a transport stages for them (even pieces only), with the same result;
asked for where it cannot run, it says why once and the torch transport runs, or it raises when strict. On GPUs:
tests/test_symm_pull_gpu.py and tests/test_graphs.py."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.backends import TorchTransport, make_transport
from streamfusion_diffusers.runtime.pool import ProcessPool

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


class _Staging(TorchTransport):
    """The torch transport with buffers of its own to pack sends into, as the symm-pull transport has on GPUs."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[int] = []
        self.sent_from: list[int] = []

    def staging(self, group, like, shape):
        buffer = like.new_empty(tuple(shape))
        self.handed.append(buffer.data_ptr())
        return buffer

    def all_to_all(self, sends, recvs, group):
        self.sent_from.append(sends[0][0].data_ptr())
        return super().all_to_all(sends, recvs, group)


def _scatter_staged(seq_lens: list[int]) -> tuple[bool, list[int], list[int]]:
    from streamfusion_diffusers.attention.ulysses import scatter_heads

    ctx = init_parallel(ParallelConfig(method="ulysses"))
    mesh = ctx.mesh(8)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(1, seq_lens[dist.get_rank()], 8, 4, generator=g) for _ in range(3)]
    staging = _Staging()
    plain, staged = scatter_heads(xs, mesh, TorchTransport(), seq_lens), scatter_heads(xs, mesh, staging, seq_lens)
    return all(torch.equal(a, b) for a, b in zip(plain, staged)), staging.handed, staging.sent_from


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


@pytest.mark.parametrize("seq_lens", [[5, 5], [5, 4]])
def test_ulysses_packs_into_the_buffer_the_transport_stages(pool, seq_lens):
    for same, handed, sent_from in pool.run(_scatter_staged, seq_lens):
        assert same
        if seq_lens[0] == seq_lens[1]:  # sent from the staged buffer itself
            assert len(handed) == 1 and sent_from == handed, (handed, sent_from)
        else:  # uneven pieces: the transport pulls none, so nothing is staged
            assert handed == [] and len(sent_from) == 1

"""The symm-pull transport (backends/symm_pull.py) off GPUs: its pull kernel, run in Triton's CPU interpreter,
puts piece `me` of every member's buffer where piece j goes, end to end or in place in Ulysses' layouts (odd
sizes, a partial last block, three dtypes), writing nothing else;
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
from streamfusion_diffusers.backends.symm_pull import BLOCK_BYTES, pull, target_of

def flat(members, numel):  # Ulysses' packed buffers: piece j at j numel
    return (members * numel,), lambda out, j: out[j * numel:(j + 1) * numel]

def rows(members):  # Ulysses' scatter in place: [n, T, B, skip + U' L, h, D], member j's L rows after the skip
    return (3, 1, 2, 2 + members * 5, 2, 4), lambda out, j: out[:, :, :, 2 + j * 5:2 + (j + 1) * 5]

def heads(members):  # its gather in place: [B, L, U' h, D], member j's heads, in its piece's order [T, B, L, h, D]
    return (1, 7, members * 2, 4), lambda out, j: out.view(1, 7, 1, members, 2, 4)[:, :, :, j].permute(2, 0, 1, 3, 4)

for dtype, members, (shape, place) in ((torch.bfloat16, 4, flat(4, 3 * BLOCK_BYTES // 2 + 6)),
                                       (torch.float32, 3, flat(3, 5)), (torch.bfloat16, 4, rows(4)),
                                       (torch.bfloat16, 2, heads(2)), (torch.float16, 4, heads(4))):
    g = torch.Generator().manual_seed(members)
    piece = place(torch.empty(shape, dtype=dtype), 0)
    buffers = [torch.randn(members, *piece.shape, generator=g).to(dtype) for _ in range(members)]
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    for me in range(members):
        out = torch.zeros(shape, dtype=dtype)
        target = target_of([place(out, j) for j in range(members)], piece.numel() * piece.element_size())
        assert target is not None, (dtype, shape)
        pull(ptrs, target, me, members)
        for j in range(members):
            assert torch.equal(place(out, j), buffers[j][me]), (dtype, shape, me, j)
            place(out, j).zero_()
        assert not out.any(), (dtype, shape, me)  # nothing written outside the pieces
print("pulled")
"""


def test_the_pull_kernel_puts_this_ranks_piece_of_every_member_in_place_in_the_interpreter():
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


def _exchanged_staged(seq_lens: list[int], batch: int) -> tuple[bool, list[int], list[int]]:
    """Ulysses' scatter of Q, K, V and its gather of an output, over the torch transport and over one that
    stages: equal results, and the buffers handed out and sent from."""
    from streamfusion_diffusers.attention.ulysses import gather_heads, scatter_heads

    ctx = init_parallel(ParallelConfig(method="ulysses"))
    mesh = ctx.mesh(8)
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(batch, seq_lens[dist.get_rank()], 8, 4, generator=g) for _ in range(3)]
    staging = _Staging()
    plain, staged = scatter_heads(xs, mesh, TorchTransport(), seq_lens), scatter_heads(xs, mesh, staging, seq_lens)
    o = torch.randn(plain[0].shape[1:], generator=g)  # [B, every peer's rows, h, D]: an attention output
    back = gather_heads([o], mesh, TorchTransport(), seq_lens), gather_heads([o], mesh, staging, seq_lens)
    same = all(torch.equal(a, b) for a, b in zip(plain, staged)) and torch.equal(*back)
    return same, staging.handed, staging.sent_from


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


@pytest.mark.parametrize("seq_lens,batch", [([5, 5], 1), ([5, 5], 2), ([5, 4], 1)])
def test_ulysses_packs_into_the_buffers_the_transport_stages_and_receives_in_place(pool, seq_lens, batch):
    for same, handed, sent_from in pool.run(_exchanged_staged, seq_lens, batch):
        assert same
        if seq_lens[0] == seq_lens[1]:  # scatter and gather sent from the staged buffers themselves
            assert len(handed) == 2 and sent_from == handed, (handed, sent_from)
        else:  # uneven pieces: the transport pulls none, so nothing is staged
            assert handed == [] and len(sent_from) == 2

"""The transports' all-to-all of pieces (3 gloo processes): every piece lands in its view, strided or not."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from sp_cases import context

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 3
CONFIGS = [ParallelConfig(machines=1, gpus_per_machine=WORLD, method="ulysses"),
           ParallelConfig(machines=WORLD, gpus_per_machine=1, method="ulysses", emulate_link="100:1")]


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def piece(src: int, dst: int, n: int) -> torch.Tensor:
    """The n-th piece src sends dst: its own shape (src + dst rows, one of them empty) and values."""
    rows = 0 if (src, dst, n) == (2, 0, 1) else src + dst + 1
    return torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 1000 * src + 100 * dst + 10 * n


def pieces_job(config: ParallelConfig) -> list[tuple[int, int, int]]:
    """(src, n, wrong elements) for every piece this rank received, plus its untouched padding (src -1)."""
    ctx = context(config)
    group, me = ctx.mesh(None).ulysses_intra, dist.get_rank()
    # piece 0 of each peer is sent from a strided view (a transposed copy) and lands contiguous; piece 1 is
    # sent contiguous and lands in a strided column slice of one result with padding around it
    sends = [[piece(me, j, 0).t().contiguous().t(), piece(me, j, 1)] for j in range(WORLD)]
    flat = [torch.full(piece(j, me, 0).shape, -1.0) for j in range(WORLD)]
    wide = torch.full((2 * WORLD + 1, 4 * WORLD + 2), -1.0)
    recvs = [[flat[j], wide[: piece(j, me, 1).shape[0], 4 * j + 1: 4 * j + 5]] for j in range(WORLD)]
    _all_to_all(ctx, sends, recvs, group)
    out = [(j, n, int((recvs[j][n] != piece(j, me, n)).sum())) for j in range(WORLD) for n in range(2)]
    padding = torch.ones(wide.shape, dtype=torch.bool)
    for j in range(WORLD):
        padding[: piece(j, me, 1).shape[0], 4 * j + 1: 4 * j + 5] = False
    return out + [(-1, 0, int((wide[padding] != -1).sum()))]


@pytest.mark.parametrize("config", CONFIGS, ids=["one-machine", "emulated-link"])
def test_every_piece_lands_in_its_view(pool, config):
    for rank, result in enumerate(pool.run(pieces_job, config)):
        wrong = [(src, n, bad) for src, n, bad in result if bad]
        assert not wrong, f"rank {rank}: (source, piece, wrong elements) {wrong}"


def _count_all_to_all_single(run) -> int:
    """How many single-tensor all-to-alls (a process group's `alltoall_base`, what `dist.all_to_all_single`
    posts) `run()` makes."""
    calls, real = [0], dist.ProcessGroup.__dict__["alltoall_base"]  # the method as the class holds it

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return real.__get__(self)(*args, **kwargs)

    dist.ProcessGroup.alltoall_base = counted
    try:
        run()
    finally:
        dist.ProcessGroup.alltoall_base = real
    return calls[0]


def _all_to_all(ctx, sends, recvs, group) -> None:
    """One all-to-all through the context's transport, as a layer posts it, waited for."""
    ctx.transport.begin_layer(0)
    ctx.transport.all_to_all(sends, recvs, group).wait()
    ctx.transport.end_layer()


def packed_job(config: ParallelConfig) -> tuple[list[int], int]:
    """Pieces end to end in one buffer each way (one per peer, uneven lengths, an empty one): (wrong elements per
    source, the all_to_all_single calls it took)."""
    ctx = context(config)
    group, me = ctx.mesh(None).ulysses_intra, dist.get_rank()
    lens = [[(src + 2 * dst) % 4 for dst in range(WORLD)] for src in range(WORLD)]  # (0, 0) and others empty
    send = torch.cat([torch.full((lens[me][j], 3), 100.0 * me + j) for j in range(WORLD)])
    recv = torch.full((sum(lens[j][me] for j in range(WORLD)), 3), -1.0)
    starts = [sum(lens[i][me] for i in range(j)) for j in range(WORLD + 1)]
    sent = [sum(lens[me][:j]) for j in range(WORLD + 1)]
    calls = _count_all_to_all_single(lambda: _all_to_all(ctx, [[send[sent[j]:sent[j + 1]]] for j in range(WORLD)],
                                                        [[recv[starts[j]:starts[j + 1]]] for j in range(WORLD)], group))
    wrong = [int((recv[starts[j]:starts[j + 1]] != 100.0 * j + me).sum()) for j in range(WORLD)]
    return wrong, calls


@pytest.mark.parametrize("config", CONFIGS, ids=["one-machine", "emulated-link"])
def test_pieces_end_to_end_go_as_one_collective(pool, config):
    """Ulysses packs what goes to each peer end to end in one buffer and receives likewise: the torch transport
    moves it with one all_to_all_single (not a send and a receive per peer), every piece where it belongs."""
    for rank, (wrong, calls) in enumerate(pool.run(packed_job, config)):
        assert wrong == [0] * WORLD and calls == 1, f"rank {rank}: wrong elements {wrong}, {calls} collective(s)"


def ulysses_collectives_job(batch: int) -> tuple[int, float]:
    """One Ulysses layer (uneven slices, joint text, `batch`): its all_to_all_single calls after the first call
    (which agrees the shapes), and its error against single-process attention."""
    from sp_cases import Problem, reference, run_rank

    from streamfusion_diffusers.core.exactness import relative_error

    config = ParallelConfig(machines=1, gpus_per_machine=WORLD, method="ulysses")
    problem = Problem(6, 16, batch, (3, 5, 4), joint=2, seed=7)
    run_rank(config, problem)
    results = []
    calls = _count_all_to_all_single(lambda: results.append(run_rank(config, problem)))
    out, joint_out = results[0]
    ref, ref_joint = reference(problem)
    me = dist.get_rank()
    rows = slice(sum(problem.seq_lens[:me]), sum(problem.seq_lens[:me + 1]))
    return calls, max(relative_error(out, ref[:, rows]), relative_error(joint_out, ref_joint))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_ulysses_layer_is_two_collectives(pool, batch):
    """Q, K and V travel as one all_to_all_single and the output as another, at batch 1 and batch 2 (whose
    output rows are packed per peer first), with uneven slices and joint text, exact."""
    for rank, (calls, err) in enumerate(pool.run(ulysses_collectives_job, batch)):
        assert calls == 2 and err < 1e-5, f"rank {rank}: {calls} collective(s), error {err}"


def alone_job() -> tuple[bool, int]:
    """A group of this rank alone (a CFG branch of one rank, whose groups have no process group) in a larger job:
    (whether the piece landed, the collectives it took)."""
    from streamfusion_diffusers.core.mesh import Group

    ctx = context(CONFIGS[0])
    alone = Group((dist.get_rank(),), 0, None, "ulysses_intra")
    send, recv = torch.arange(6.0) + dist.get_rank(), torch.full((6,), -1.0)
    calls = _count_all_to_all_single(lambda: _all_to_all(ctx, [[send]], [[recv]], alone))
    return bool(torch.equal(send, recv)), calls


def test_a_group_of_one_copies_without_a_collective(pool):
    """A one-rank group has no process group: a collective on it would go to the job's default group."""
    assert pool.run(alone_job) == [(True, 0)] * WORLD

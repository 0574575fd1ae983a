"""Cross-rank input agreement: every rank of an SP world must call `sp_attention` with the same shapes.

A rank cannot see its peers' tensors, yet every schedule sizes its first collective from them: one rank with a
different slice length makes gloo abort the process and NCCL hang or return garbage. So the first call with a
new local signature gathers a few ints from every rank in one small all_gather, before any shape-dependent
collective, and raises the same ValueError on every rank when they differ, naming the ranks and the fix. A
local refusal (bad shapes, wrong seq_lens) travels in the same gather, so every rank raises, none waits.
Signatures that agreed once are cached per context: later calls cost nothing. (A rank that alone changes to
a new signature after that runs the check alone and waits until the process group's timeout.)
"""
from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.mesh import Group

_DTYPES = sorted({str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)})
_FIELDS = ("batch", "heads", "head dim", "dtype", "joint length")  # columns 1-5 of a row; 6: slice length
SHARD_HINT = "streamfusion_diffusers.core.sequence.split_sizes(L, P) and shard(...) cut a sequence that way"


def check_inputs(q: Tensor, k: Tensor, v: Tensor, joint: tuple[Tensor | None, ...]) -> None:
    """This rank's own inputs: one [B, L_local, H, D] shape for q, k, v; joint tokens all or none, like q."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one [B, L_local, H, D] shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    given = [x is not None for x in joint]
    if any(given) and not all(given):
        raise ValueError("pass joint_q, joint_k and joint_v together (or none of them)")
    if all(given):
        jq, jk, jv = joint
        b, _, h, d = q.shape
        if jq.shape != jk.shape or jq.shape != jv.shape or (jq.shape[0], jq.shape[2], jq.shape[3]) != (b, h, d):
            raise ValueError(f"joint tokens must be [B, L_joint, H, D] = [{b}, L, {h}, {d}] like q; got "
                             f"{tuple(jq.shape)}, {tuple(jk.shape)}, {tuple(jv.shape)}")


def check_seq_lens(seq_lens: Sequence[int] | None, local: int, rank: int, world: int) -> list[int]:
    """Every rank's slice length as this rank believes it (all equal to its own when seq_lens is None)."""
    if seq_lens is None:
        return [local] * world
    lens = list(seq_lens)
    if len(lens) != world or any(n < 0 for n in lens):
        raise ValueError(f"seq_lens must list {world} non-negative slice lengths, one per rank; got {lens}")
    if lens[rank] != local:
        raise ValueError(f"rank {rank} holds {local} tokens but seq_lens[{rank}] = {lens[rank]}; shard the sequence "
                         f"with streamfusion_diffusers.core.sequence.shard and pass split_sizes(L, {world})")
    return lens


def _crc(values: Sequence[int]) -> int:
    return zlib.crc32(",".join(map(str, values)).encode())


def _where(values: Sequence, ranks: Sequence[int]) -> str:
    """'2 on ranks [0, 1, 3], 1 on rank [2]': each distinct value with the ranks that hold it."""
    by_value: dict = {}
    for value, rank in zip(values, ranks):
        by_value.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on rank{'s' if len(rs) > 1 else ''} {rs}" for value, rs in by_value.items())


def disagreement(rows: list[list[int]], ranks: Sequence[int]) -> str | None:
    """What the gathered rows (one per rank: refused, batch, heads, head dim, dtype, joint, slice length, lens
    crc, seq_lens given) disagree on, as the message every rank raises; None when they all agree."""
    refused = [rank for row, rank in zip(rows, ranks) if row[0]]
    if refused:
        return f"rank(s) {refused} refused their inputs (see the error there); fix them on every rank"
    problems = []
    for col, name in enumerate(_FIELDS, start=1):
        values = [row[col] for row in rows]
        if len(set(values)) > 1:
            shown = [_DTYPES[x] for x in values] if name == "dtype" else values
            usual = Counter(values).most_common(1)[0][0]
            odd = sorted(r for r, x in zip(ranks, values) if x != usual)
            problems.append(f"{name} differs ({_where(shown, ranks)}): ranks {odd} disagree with the rest; "
                            f"every rank must pass the same {name}")
    held = [row[6] for row in rows]
    wrong = [rank for row, rank in zip(rows, ranks) if row[7] != _crc(held)]
    if wrong:
        if not any(row[8] for row in rows):
            problems.append(f"slice lengths differ ({_where(held, ranks)}) but seq_lens was not given: pass "
                            f"seq_lens={held} on every rank ({SHARD_HINT})")
        else:
            problems.append(f"seq_lens on rank(s) {wrong} does not match the slice lengths the ranks hold: pass "
                            f"seq_lens={held} on every rank ({SHARD_HINT})")
    return "; ".join(problems) if problems else None


def _capturing() -> bool:
    """True while a CUDA graph is being captured (no collective may run, nor any host read of a result)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _gather(row: list[int], group: Group) -> list[list[int]]:
    backend = str(dist.get_backend(group.pg))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(everyone, mine, group=group.pg)
    return torch.stack(everyone).tolist()


def agreed_seq_lens(ctx, q: Tensor, k: Tensor, v: Tensor, joint: tuple[Tensor | None, ...],
                    seq_lens: Sequence[int] | None) -> list[int]:
    """Every rank's slice length, once every rank of the SP world has agreed on the inputs' shapes.

    Collective at the first call with a new signature (nothing later, nor while a CUDA graph is captured).
    """
    group: Group = ctx.cfg.sp
    try:
        check_inputs(q, k, v, joint)
        lens = check_seq_lens(seq_lens, q.shape[1], group.index, group.size)
    except ValueError:
        if group.size > 1 and not _capturing():
            _gather([1] + [0] * 8, group)  # tell the peers, so that they raise too instead of waiting
        raise
    joint_len = joint[0].shape[1] if joint[0] is not None else 0
    signature = (tuple(q.shape), q.dtype, joint_len, tuple(lens))
    seen = ctx.agreed
    if group.size == 1 or signature in seen or _capturing():
        return lens
    b, local, heads, d = q.shape
    row = [0, b, heads, d, _DTYPES.index(str(q.dtype)), joint_len, local, _crc(lens), int(seq_lens is not None)]
    problem = disagreement(_gather(row, group), group.ranks)
    if problem is not None:
        raise ValueError(f"sp_attention inputs differ between ranks: {problem}")
    seen.add(signature)
    return lens

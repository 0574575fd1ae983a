"""How a global token sequence is cut into per-rank slices, and put back together."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.13 renames all_gather_into_tensor; the old name still works on 2.9 - 2.12
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def split_sizes(length: int, parts: int) -> list[int]:
    """Slice lengths of `length` tokens over `parts` ranks, as torch.tensor_split cuts them (first ranks +1).

    Integer arithmetic only (no divmod, no comparison): under torch.compile `length` may be a SymInt, and each
    slice stays an expression of it, so a recompiled graph serves every size without a guard per remainder."""
    if parts < 1:
        raise ValueError(f"cannot split a sequence over {parts} ranks")
    return [(length + parts - 1 - i) // parts for i in range(parts)]


def shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """The rank-th contiguous slice of x along dim (uneven lengths allowed, as in `split_sizes`)."""
    return torch.tensor_split(x, world_size, dim=dim)[rank]


def gather(x: Tensor, seq_lens: list[int], group: dist.ProcessGroup | None = None, dim: int = 1) -> Tensor:
    """All-gather every rank's slice along dim and concatenate them in rank order; slices may differ in length."""
    if len(seq_lens) == 1:
        return x
    longest = max(seq_lens)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous() if pad[dim] else x.contiguous()
    buf = padded.new_empty((len(seq_lens), *padded.shape))
    _all_gather_single(buf.view(-1, *padded.shape[1:]), padded, group=group)
    return torch.cat([buf[i].narrow(dim, 0, n) for i, n in enumerate(seq_lens)], dim=dim)

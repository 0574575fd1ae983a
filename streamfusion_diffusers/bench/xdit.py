"""xDiT's USP attention (yunchang's LongContextAttention), the baseline users run today."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.extras import missing
from ..core.mesh import GroupCache

INSTALL_HINT = f"the xdit-usp baseline {missing('yunchang')}"


def available() -> bool:
    try:
        import yunchang  # noqa: F401
    except ImportError:
        return False
    return True


def _use_groups(ulysses: int, ring: int, set_seq_parallel_pg, groups: GroupCache) -> None:
    """Point yunchang at its process groups for U x R, created once per job and kept in the job's `groups`:
    `set_seq_parallel_pg` makes new groups (NCCL communicators, initialized at their first collective) at every
    call, and a bench job with several workloads used to call it for every xdit-usp case of every workload."""
    from yunchang.globals import PROCESS_GROUP

    def make() -> tuple:
        set_seq_parallel_pg(ulysses, ring, dist.get_rank(), dist.get_world_size(), use_ulysses_low=True)
        return PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG

    PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = groups.other(("yunchang", ulysses, ring), make)


class XdiTUSP:
    """USP at Ulysses degree U x Ring degree R, with Ulysses peers adjacent (yunchang's use_ulysses_low), on
    process groups kept in the job's `groups` (a context's GroupCache, emptied by shutdown)."""

    def __init__(self, ulysses: int, ring: int, device: torch.device, groups: GroupCache):
        try:
            from yunchang import LongContextAttention, set_seq_parallel_pg
            from yunchang.kernels import AttnType
        except ImportError as err:
            raise RuntimeError(INSTALL_HINT) from err
        if ring > 1 and device.type != "cuda":
            raise ValueError("yunchang's ring needs a CUDA attention that returns the log-sum-exp; on the CPU run "
                             "xdit-usp with ring=1 only")
        _use_groups(ulysses, ring, set_seq_parallel_pg, groups)
        # yunchang 0.6.4's TORCH_CUDNN and TORCH_MATH paths return an all-zero LSE, which is right only when no
        # ring merge follows (ring = 1); with a ring, TORCH_FLASH is its fastest correct path here.
        if device.type != "cuda":
            kind = AttnType.TORCH_MATH
        else:
            kind = AttnType.TORCH_CUDNN if ring == 1 else AttnType.TORCH_FLASH
        self.attention = LongContextAttention(ring_impl_type="basic", attn_type=kind)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.attention(q, k, v)

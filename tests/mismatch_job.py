"""A user's script under torchrun (4 gloo ranks): rank 2 holds one token more than the others and no seq_lens
is given. Each method's error is printed; the last one ends the script, uncaught, as it would a user's."""
from __future__ import annotations

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.core.config import METHODS

dist.init_process_group("gloo")
rank = dist.get_rank()
q, k, v = (torch.randn(1, 9 if rank == 2 else 8, 4, 16) for _ in range(3))
jq, jk, jv = (torch.randn(1, 4, 4, 16) for _ in range(3))
for i, method in enumerate(METHODS):
    ctx = init_parallel(ParallelConfig(machines=2, gpus_per_machine=2, method=method, timeout_s=30))
    try:
        sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)
    except ValueError as err:
        print(f"rank {rank} {method}: {err}", flush=True)
        if i == len(METHODS) - 1:
            raise

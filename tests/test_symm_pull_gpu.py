"""The symm-pull transport (backends/symm_pull.py) on GPUs: its pulled all-to-alls move what NCCL's move, so a
parallelized model gives the torch transport's output bit for bit, eagerly (graph replays: tests/test_graphs.py);
and the pulls run: each exchange size got its buffers."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
from model_cases import Case, context
from torch.utils._pytree import tree_map_only

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.runtime.pool import ProcessPool

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]
EVEN = Case("flux", (8, 8), text=8)  # 64 image and 8 text tokens: even pieces on 2 and 4 ranks (uneven: NCCL's)


def _against_torch(method: str, seed: int) -> tuple[float, int]:
    """On every rank: the largest difference between the two transports' outputs, and the buffers the symm-pull
    transport made (0: it never pulled). One kernel and one layout for both: a choice by timing may differ."""
    inputs = tree_map_only(torch.Tensor, lambda x: x.cuda().to(torch.bfloat16) if x.is_floating_point() else x.cuda(),
                           EVEN.inputs(seed + 1))
    layout = {"ulysses": GPUS} if method == "ulysses" else {"ulysses": 2}
    outs, made = [], 0
    with torch.inference_mode():
        for backend in ("torch", "symm-pull"):
            ctx = context(ParallelConfig(method=method, backend=backend, kernel="sdpa", strict=True, **layout))
            model = build_transformer(EVEN.config, seed=seed, dtype=torch.bfloat16, device=torch.device("cuda"))
            parallelize(model, ctx)
            outs.append(model(**inputs).sample.float())
            unparallelize(model)
            made = sum(len(slots) for slots in getattr(ctx.transport, "_slots", {}).values())
    dist.barrier()
    return (outs[0] - outs[1]).abs().max().item(), made


@pytest.fixture(scope="module")
def gpu_pool():
    with ProcessPool(GPUS, backend="nccl") as pool:
        yield pool


@pytest.mark.parametrize("method", ["ulysses", "usp"])
def test_pulled_all_to_alls_give_the_torch_transports_output(gpu_pool, method):
    for rank, (diff, made) in enumerate(gpu_pool.run(_against_torch, method, 5)):
        assert diff == 0.0, f"rank {rank}: {diff}"
        assert made > 0, f"rank {rank}: the symm-pull transport pulled nothing"

"""Every method on the NVSHMEM transport against single-GPU attention and against NCCL, on all local GPUs
(one process each). Needs 2+ GPUs and nvshmem4py; skipped elsewhere."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.config import METHODS
from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.core.sequence import split_sizes

WORLD = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(WORLD < 2, reason="needs 2 or more CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None, reason="needs nvshmem4py"),
]
MESHES = [(n, WORLD // n) for n in sorted({1, 2, WORLD}) if WORLD >= 2 and WORLD % n == 0]


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD, backend="nccl") as p:
        yield p


def _errors(machines: int, method: str, seed: int) -> dict[str, float]:
    """Relative error of NVSHMEM against float32 attention and against NCCL, on this rank's rows and joint rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cuda").manual_seed(seed)
    length, heads, dim, joint = 97 * world + 5, 24, 64, 31
    q, k, v, jq, jk, jv = (torch.randn((1, n, heads, dim), generator=g, device="cuda", dtype=torch.bfloat16)
                           for n in (length,) * 3 + (joint,) * 3)
    lens = split_sizes(length, world)
    rows = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    ref = reference_attention(torch.cat([jq, q[:, rows]], 1), torch.cat([jk, k], 1), torch.cat([jv, v], 1))
    outs = {}
    for backend in ("torch", "nvshmem"):
        ctx = init_parallel(ParallelConfig(machines=machines, gpus_per_machine=world // machines, method=method,
                                           backend=backend, strict=True))
        out, jout = sp_attention(q[:, rows], k[:, rows], v[:, rows], ctx, joint_q=jq, joint_k=jk, joint_v=jv,
                                 seq_lens=lens)
        outs[backend] = torch.cat([jout, out], 1).float()
    return {"reference": relative_error(outs["nvshmem"], ref), "nccl": relative_error(outs["nvshmem"], outs["torch"])}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_nvshmem_matches_reference_and_nccl(pool, mesh, method):
    seed = torch.randint(0, 2**31 - 1, ()).item()
    for rank, err in enumerate(pool.run(_errors, mesh[0], method, seed)):
        assert err["reference"] <= threshold(torch.bfloat16), f"rank {rank} seed {seed}: {err}"
        assert err["nccl"] <= threshold(torch.bfloat16), f"rank {rank} seed {seed}: {err}"

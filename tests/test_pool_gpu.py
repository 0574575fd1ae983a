"""GPU ranks forked from the pool's fork server (runtime/pool.py): CUDA starts in each, on its own GPU, and a second
pool starts in a fraction of the first's time (the server imported torch, diffusers and the package once)."""
from __future__ import annotations

import time

import pytest
import torch

from streamfusion_diffusers.runtime.pool import ProcessPool

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _on_my_gpu() -> tuple[int, float]:
    x = torch.ones(256, 256, device="cuda")
    return torch.cuda.current_device(), float((x @ x).sum())


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
def test_forked_gpu_ranks_start_cuda_each_on_its_own_gpu():
    starts = []
    for _ in range(2):
        began = time.perf_counter()
        with ProcessPool(GPUS, backend="nccl") as pool:
            starts.append(time.perf_counter() - began)
            answers = pool.run(_on_my_gpu)
        assert [a[0] for a in answers] == list(range(GPUS)), answers
        assert all(a[1] == 256.0 ** 3 for a in answers), answers
    assert starts[1] < starts[0], starts  # the second pool's ranks fork from the warm server

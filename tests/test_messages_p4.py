"""Fallbacks and choices are said once per job, on global rank 0 (4 gloo processes): a job of two nvshmem
contexts without a GPU (the fallback), method "auto" and a parallelized tiny Flux forward logs each message
once in all, not once per rank or per context."""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from model_cases import FLUX_CASES

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.models.build import build_transformer

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD, timeout_s=60) as p:
        yield p


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def job_messages() -> list[tuple[int, str]]:
    """(level, text) of every package message this rank logs in a small job with fallbacks and choices."""
    package = logging.getLogger("streamfusion_diffusers")
    kept, level = _Kept(), package.level
    package.addHandler(kept)
    package.setLevel(logging.INFO)
    try:
        configs = [ParallelConfig(machines=2, gpus_per_machine=2, method="auto", backend="nvshmem"),
                   ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", backend="nvshmem")]
        contexts = [init_parallel(c) for c in configs]
        case = FLUX_CASES["text-sharded-uneven-image"]
        model = build_transformer(case.config, seed=0)
        parallelize(model, contexts[0])
        with torch.no_grad():
            model(**case.inputs(1))
    finally:
        package.removeHandler(kept)
        package.setLevel(level)
    return [(r.levelno, r.getMessage()) for r in kept.records]


def test_each_message_once_on_rank_0(pool):
    per_rank = pool.run(job_messages)
    assert per_rank[1:] == [[]] * (WORLD - 1), per_rank[1:]
    counts = Counter(text for _, text in per_rank[0])
    assert all(n == 1 for n in counts.values()), counts
    fallbacks = [t for level, t in per_rank[0] if level == logging.WARNING and "backend 'nvshmem' cannot run" in t]
    assert len(fallbacks) == 1 and "falling back" in fallbacks[0], per_rank[0]
    assert any(t.startswith("streamfusion auto:") for t in counts), counts
    assert any(t.startswith("parallelized FluxTransformer2DModel over 4 ranks") for t in counts), counts

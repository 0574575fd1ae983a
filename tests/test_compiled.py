"""`compile_blocks`: the blocks' non-attention parts under torch.compile, attention eager between them (the graph
breaks at `processors.base.attend`), give the unparallelized model's output on tiny Flux and CogVideoX over 2 gloo
processes, on fresh inputs after the first compile too; `uncompile_blocks` runs them eager again. On the CPU the
test compiles with BACKEND (inductor needs a C++ toolchain and minutes; aot_eager traces and partitions the same
graphs); the GPU test compiles with inductor."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_cases import COGVIDEOX_CASES, FLUX_CASES, TOL, Case, context
from torch.utils._pytree import tree_map_only

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.compiled import compile_blocks, repeated_blocks, uncompile_blocks
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.parallelize import parallelize, unparallelize
from streamfusion_diffusers.spawn import ProcessPool

BACKEND = "aot_eager"
CASES = {"flux-text-joint": FLUX_CASES["text-joint-batch2"], "cogvideox-rope": COGVIDEOX_CASES["rope-text-joint"]}
CONFIGS = {"usp-1x2": ParallelConfig(method="usp"), "torus-2x1": ParallelConfig(machines=2, method="torus")}


def compiled_vs_reference(config: ParallelConfig, case: Case, seed: int, backend: str, device: str = "cpu",
                          dtype: torch.dtype = torch.float32, waves: int | None = None) -> dict:
    """On every rank: relative errors of the compiled parallel forward against the unparallelized one, for two
    inputs (the second replays the compiled code), the graphs Dynamo made, and whether uncompile undid it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # a fresh compile on each call, so that the graphs counted are this case's
    move = lambda x: x.to(device, dtype) if x.is_floating_point() else x.to(device)  # noqa: E731
    model = build_transformer(case.config, seed=seed, dtype=dtype, device=device)
    calls = [tree_map_only(torch.Tensor, move, case.inputs(seed + i)) for i in (1, 2)]
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.no_grad():
        references = [model(**inputs).sample for inputs in calls]
        parallelize(model, context(config), waves=waves)
        graphs = counters["stats"]["unique_graphs"]
        compile_blocks(model, backend=backend)
        outs = [model(**inputs).sample for inputs in calls]
        graphs = counters["stats"]["unique_graphs"] - graphs
        uncompile_blocks(model)
        eager_again = all(b._compiled_call_impl is None for b in repeated_blocks(model))
        unparallelize(model)
    dist.barrier()
    return {"errors": [rel(o, r) for o, r in zip(outs, references)], "graphs": graphs, "eager_again": eager_again}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


@pytest.mark.parametrize("config,case", [("usp-1x2", "flux-text-joint"), ("torus-2x1", "flux-text-joint"),
                                         ("usp-1x2", "cogvideox-rope")])
def test_compiled_blocks_match_the_unparallelized_model(pool, config, case):
    for res in pool.run(compiled_vs_reference, CONFIGS[config], CASES[case], 5, BACKEND):
        assert max(res["errors"]) <= TOL, res
        assert res["graphs"] >= 2, res  # at least one graph before and one after the attention of a block
        assert res["eager_again"], res


def test_compiled_blocks_with_waves_match(pool):
    """Blocks in waves interleave their parts with posted transfers: the wave schedule runs eager (and fast to
    compile: Dynamo does not trace into it)."""
    for res in pool.run(compiled_vs_reference, CONFIGS["usp-1x2"], CASES["flux-text-joint"], 5, BACKEND, waves=2):
        assert max(res["errors"]) <= TOL, res


def test_a_model_without_blocks_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="takes a Flux or CogVideoX transformer"):
        compile_blocks(torch.nn.Linear(2, 2))


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("case", CASES)
def test_inductor_compiled_blocks_on_gpus(case):
    with ProcessPool(2, backend="nccl") as gpu_pool:
        for res in gpu_pool.run(compiled_vs_reference, CONFIGS["usp-1x2"], CASES[case], 5, "inductor", "cuda",
                                torch.bfloat16):
            assert max(res["errors"]) <= 2e-2, res
            assert res["graphs"] >= 2, res

"""A parallelized transformer compiles as diffusers users compile it, with `fullgraph=True` (issue 25):
`torch.compile(model, fullgraph=True)` and `compile_repeated_blocks(fullgraph=True)` over 4 gloo processes, for
every method, auto and the CFG split, each attention one `streamfusion::sp_attention` node in the graph; the
compiled output matches the eager parallel one and the unparallelized model, on fresh inputs after the first
compile too. On the CPU the test compiles with aot_eager (inductor needs a C++ toolchain and minutes; aot_eager
traces and partitions the same graphs); the GPU test compiles with inductor and CUDA graphs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from model_cases import COGVIDEOX_CASES, FLUX_CASES, TOL, Case, context
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._pytree import tree_map_only

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.commands.spawn import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.compiled import compile_blocks, repeated_blocks, uncompile_blocks
from streamfusion_diffusers.models.build import build_transformer

FLUX = FLUX_CASES["text-joint-batch2"]  # 7 text tokens on 4 ranks: joint tokens; batch 2 for the CFG split
CONFIGS = {"ulysses": ParallelConfig(method="ulysses"), "ring": ParallelConfig(method="ring"),
           "usp": ParallelConfig(method="usp", ulysses=2), "tas": ParallelConfig(method="tas"),
           "torus": ParallelConfig(machines=2, method="torus"), "auto": ParallelConfig(method="auto"),
           "usp-cfg2": ParallelConfig(method="usp", cfg=2)}


def compiled_vs_eager(config: ParallelConfig, case: Case, seed: int, how: str, backend: str = "aot_eager",
                      device: str = "cpu", dtype: torch.dtype = torch.float32, mode: str | None = None) -> dict:
    """On every rank: relative errors of the compiled parallel forward against the eager parallel one and the
    unparallelized one, for two inputs (the second replays the compiled code), and the sp_attention nodes of
    each graph Dynamo made. how: "whole" (torch.compile of the model) or "blocks" (compile_repeated_blocks)."""
    torch._dynamo.reset()
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(sum("streamfusion.sp_attention" in str(n.target) for n in gm.graph.nodes))
        if mode == "reduce-overhead":  # what torch.compile(mode="reduce-overhead") asks of inductor
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True})
        return lookup_backend(backend)(gm, example_inputs)

    move = lambda x: x.to(device, dtype) if x.is_floating_point() else x.to(device)  # noqa: E731
    model = build_transformer(case.config, seed=seed, dtype=dtype, device=device)
    calls = [tree_map_only(torch.Tensor, move, case.inputs(seed + i)) for i in (1, 2)]
    with torch.no_grad():
        references = [model(**inputs).sample for inputs in calls]
        parallelize(model, context(config))
        eager = [model(**inputs).sample for inputs in calls]
        if how == "whole":
            run = torch.compile(model, fullgraph=True, dynamic=False, backend=counting)
        else:
            model.compile_repeated_blocks(fullgraph=True, dynamic=False, backend=counting)
            run = model
        outs = [run(**inputs).sample.clone() for inputs in calls]
        uncompile_blocks(model)
        unparallelize(model)
    dist.barrier()
    return {"vs_eager": [relative_error(o, e) for o, e in zip(outs, eager)],
            "vs_reference": [relative_error(o, r) for o, r in zip(outs, references)], "graphs": graphs,
            "attention_layers": len(repeated_blocks(model))}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4) as p:
        yield p


@pytest.mark.parametrize("config", CONFIGS)
def test_whole_model_compiles_as_one_graph_and_matches(pool, config):
    for res in pool.run(compiled_vs_eager, CONFIGS[config], FLUX, 5, "whole"):
        assert len(res["graphs"]) == 1 and res["graphs"][0] == res["attention_layers"], res
        assert max(res["vs_eager"]) <= 1e-5, res
        assert max(res["vs_reference"]) <= TOL, res


def test_repeated_blocks_compile_with_fullgraph(pool):
    for res in pool.run(compiled_vs_eager, CONFIGS["torus"], FLUX, 5, "blocks"):
        assert res["graphs"] == [1, 1], res  # one graph per block class (joint, single), attention inside each
        assert max(res["vs_eager"]) <= 1e-5 and max(res["vs_reference"]) <= TOL, res


def test_cogvideox_compiles_whole(pool):
    for res in pool.run(compiled_vs_eager, CONFIGS["usp"], COGVIDEOX_CASES["rope-text-joint"], 5, "whole"):
        assert res["graphs"] == [res["attention_layers"]], res
        assert max(res["vs_eager"]) <= 1e-5 and max(res["vs_reference"]) <= TOL, res


def bound_compiled_vs_eager(config: ParallelConfig, case: Case, seed: int) -> dict:
    """On every rank: the bench's no-communication bound (a custom op too) compiled whole with fullgraph=True
    against its eager run (the same random keys, made at the first call), and its nodes in the graph."""
    from streamfusion_diffusers.bench.model import FluxBoundProcessor

    torch._dynamo.reset()
    nodes: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        nodes.append(sum("streamfusion.local_attention" in str(n.target) for n in gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)

    model = build_transformer(case.config, seed=seed)
    inputs = case.inputs(seed + 1)
    with torch.no_grad():
        parallelize(model, context(config))
        model.set_attn_processor(FluxBoundProcessor(context(config), model._streamfusion.state))
        eager = model(**inputs).sample
        out = torch.compile(model, fullgraph=True, backend=counting)(**inputs).sample
        unparallelize(model)
    return {"vs_eager": relative_error(out, eager), "nodes": nodes,
            "attention_layers": len(repeated_blocks(model))}


def test_the_bench_bound_compiles_as_one_graph(pool):
    for res in pool.run(bound_compiled_vs_eager, CONFIGS["usp"], FLUX, 5):
        assert res["nodes"] == [res["attention_layers"]] and res["vs_eager"] <= 1e-5, res


def test_compile_blocks_is_deprecated_naming_the_replacement():
    model = build_transformer(FLUX.config)
    with pytest.warns(DeprecationWarning, match="compile_repeated_blocks"):
        blocks = compile_blocks(model, backend="aot_eager")
    assert all(b._compiled_call_impl is not None for b in blocks)
    uncompile_blocks(model)
    assert all(b._compiled_call_impl is None for b in blocks)
    with pytest.raises(ValueError, match="takes a Flux or CogVideoX transformer"), pytest.warns(DeprecationWarning):
        compile_blocks(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_whole_model_on_one_gpu(mode):
    with ProcessPool(1, backend="nccl") as gpu_pool:
        for res in gpu_pool.run(compiled_vs_eager, CONFIGS["ulysses"], FLUX, 5, "whole", "inductor", "cuda",
                                torch.bfloat16, mode):
            assert res["graphs"] == [res["attention_layers"]], res
            assert max(res["vs_eager"]) <= 2e-2, res


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_inductor_reduce_overhead_over_two_gpus():
    """Every method at P = 2 over NCCL compiled whole with inductor and CUDA graphs (mode="reduce-overhead")."""
    configs = [ParallelConfig(method="ulysses"), ParallelConfig(method="ring"), ParallelConfig(method="tas"),
               ParallelConfig(machines=2, method="torus"), ParallelConfig(method="auto"),
               ParallelConfig(method="usp", cfg=2)]
    with ProcessPool(2, backend="nccl") as gpu_pool:
        for config in configs:
            for res in gpu_pool.run(compiled_vs_eager, config, FLUX, 5, "whole", "inductor", "cuda",
                                    torch.bfloat16, "reduce-overhead"):
                assert res["graphs"] == [res["attention_layers"]], (config, res)
                assert max(res["vs_eager"]) <= 2e-2, (config, res)

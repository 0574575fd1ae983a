"""A parallelized transformer compiles as diffusers users compile it, with `fullgraph=True`:
`torch.compile(model, fullgraph=True)` and `compile_repeated_blocks(fullgraph=True)` over 4 gloo processes, for
every method, auto and the CFG split, each attention one `streamfusion::sp_attention` node in the graph; the
compiled output matches the eager parallel one and the unparallelized model, on fresh inputs after the first
compile too. On the CPU the test compiles with aot_eager (inductor needs a C++ toolchain and minutes; aot_eager
traces and partitions the same graphs); the GPU test compiles with inductor and CUDA graphs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import plan_cases
from model_cases import COGVIDEOX_CASES, FLUX_CASES, TOL, Case, context
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._pytree import tree_map_only

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.compiled import repeated_blocks, uncompile_blocks
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.models.inputs import build

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


# one model at three sizes under two layouts: a first size, a second one (Dynamo recompiles with symbolic sizes),
# then, re-parallelized with another layout, a text that goes from split to whole on every rank (fewer tokens
# than ranks: joint tokens)
SIZES = [((8, 8), 8), ((6, 10), 9), ((5, 7), 3)]  # (token grid, text tokens)
RESIZED = {"flux": [Case("flux", grid, text=text) for grid, text in SIZES],
           "qwen-image": [plan_cases.Case("qwen-image", grid, text=text) for grid, text in SIZES]}
RELAYOUTS = [(ParallelConfig(method="usp", ulysses=2), 2), (ParallelConfig(method="torus", machines=2), 1)]
RELAYOUTS_P1 = [(ParallelConfig(method="ulysses"), 2), (ParallelConfig(method="ring", kernel="sdpa"), 1)]


def recompiled_vs_reference(family: str, how: str, relayouts: list = RELAYOUTS, backend: str = "aot_eager",
                            device: str = "cpu") -> dict:
    """On every rank: one model compiled once with fullgraph=True (Dynamo's default automatic dynamic shapes),
    run at the sizes of RESIZED[family] under `relayouts` in turn (re-parallelized between them), each output
    against the unparallelized model's (float32); and whether Dynamo made a graph with symbolic sizes."""
    assert torch._dynamo.config.automatic_dynamic_shapes  # the default, that makes a recompile symbolic
    torch._dynamo.reset()
    symbolic: list[bool] = []

    def noting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        symbolic.append(any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
            isinstance(n, torch.SymInt) for n in x.shape)) for x in example_inputs))
        return lookup_backend(backend)(gm, example_inputs)

    cases = RESIZED[family]
    model = (build_transformer(cases[0].config, seed=3) if family == "flux" else cases[0].model(3)).to(device)
    calls = [tree_map_only(torch.Tensor, lambda x: x.to(device), case.inputs(4)) for case in cases]
    errors = []
    with torch.no_grad():
        references = [model(**inputs, return_dict=False)[0] for inputs in calls]
        if how == "whole":
            run = torch.compile(model, fullgraph=True, backend=noting)
        else:
            model.compile_repeated_blocks(fullgraph=True, backend=noting)
            run = model
        done = 0
        for config, sizes in relayouts:
            parallelize(model, context(config))
            for inputs, ref in zip(calls[done:done + sizes], references[done:done + sizes]):
                errors.append(relative_error(run(**inputs, return_dict=False)[0].cpu(), ref.cpu()))
            done += sizes
            unparallelize(model)
    if how == "blocks":
        uncompile_blocks(model)
    return {"errors": errors, "graphs": len(symbolic), "symbolic": any(symbolic)}


# Qwen-Image compiles by blocks: its whole forward checks the text mask's values (data-dependent, no fullgraph)
@pytest.mark.parametrize("family, how", [pytest.param("flux", "whole", marks=pytest.mark.slow),
                                         ("qwen-image", "blocks")])
def test_recompiled_at_new_sizes_and_layouts(pool, family, how):
    """A compiled model that sees a second size recompiles with symbolic sizes, which the plan's hooks
    and the token split must trace (no Python arithmetic on a SymInt); every output stays exact."""
    for res in pool.run(recompiled_vs_reference, family, how):
        assert res["symbolic"], res  # the recompiled graphs really had symbolic sizes
        assert len(res["errors"]) == len(RESIZED[family]) and max(res["errors"]) <= TOL, res


def graphs_over_calls(family: str, calls: int = 4) -> list[int]:
    """On every rank: the graphs dynamo holds after each call of a parallelized model of three repeated blocks,
    each compiled as `generate --compile` compiles them (dynamo's eager backend: the guards are what is tested),
    with fresh inputs of one shape at every call."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    case = plan_cases.Case(family, (2, 4, 4) if family == "wan" else (8, 8), text=8)
    model = build(family, {**plan_cases.CONFIGS[family], "num_layers": 3}, seed=3)
    counts = []
    with torch.no_grad():
        parallelize(model, context(ParallelConfig(method="ulysses")))
        for block in repeated_blocks(model):
            block.compile(backend="eager", fullgraph=True)
        for i in range(calls):
            model(**case.inputs(4 + i), return_dict=False)
            counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        uncompile_blocks(model)
        unparallelize(model)
    return counts


@pytest.mark.parametrize("family", ["qwen-image", "wan"])
def test_compiled_blocks_compile_once_and_never_again(pool, family):
    """The plan's split hooks sit inside each compiled block: a hook that read its per-size cache there guarded the
    graph on the cache's contents, so the second call compiled every hooked block again (inside the CUDA-graph
    capture, where a compile cannot run); and a block of two hooks beside blocks of one compiled apart from them.
    The first block, which alone cuts the image tokens, compiles apart; every other block shares one graph."""
    for counts in pool.run(graphs_over_calls, family):
        assert counts[0] <= 2 and counts == [counts[0]] * len(counts), counts


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


def test_uncompile_blocks_runs_every_block_eager_again():
    model = build_transformer(FLUX.config)
    blocks = repeated_blocks(model)
    for block in blocks:
        block.compile(backend="aot_eager")
    assert all(b._compiled_call_impl is not None for b in blocks)
    uncompile_blocks(model)
    assert all(b._compiled_call_impl is None for b in blocks)
    with pytest.raises(ValueError, match="pass a Flux or CogVideoX transformer"):
        repeated_blocks(torch.nn.Linear(2, 2))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family, how", [("flux", "whole"), ("qwen-image", "blocks")])
def test_inductor_recompiles_at_new_sizes_and_layouts_on_one_gpu(family, how):
    """The same on a GPU: inductor, float32, three sizes under two layouts (P = 1: ulysses, then ring on
    the sdpa kernel), every output exact against the unparallelized model."""
    with ProcessPool(1, backend="nccl") as gpu_pool:
        for res in gpu_pool.run(recompiled_vs_reference, family, how, RELAYOUTS_P1, "inductor", "cuda"):
            assert res["symbolic"], res
            assert len(res["errors"]) == len(RESIZED[family]) and max(res["errors"]) <= TOL, res


def compiled_in_the_graph(family: str) -> tuple[list[float], list[int]]:
    """On one GPU: three repeated blocks compiled with inductor (as `generate --compile`), the forward replayed
    from our CUDA graph (parallelize(cuda_graph=True): a first call eager, the second captured, the third
    replayed); each output's relative error against the compiled eager forward of the same inputs, and the
    graphs dynamo holds after each graphed call (a compile during the warm-up or the capture adds one)."""
    from streamfusion_diffusers.diffusers.compiled import compile_transformers

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    case = plan_cases.Case(family, (2, 4, 4) if family == "wan" else (8, 8), text=8)
    model = build(family, {**plan_cases.CONFIGS[family], "num_layers": 3}, seed=3).to("cuda", torch.bfloat16)
    move = lambda x: x.to("cuda", torch.bfloat16) if x.is_floating_point() else x.to("cuda")  # noqa: E731
    calls = [tree_map_only(torch.Tensor, move, case.inputs(4 + i)) for i in range(3)]
    with torch.no_grad():
        parallelize(model, context(ParallelConfig(method="ulysses")))
        compile_transformers(type("Pipe", (), {"transformer": model})())
        eager = [model(**inputs, return_dict=False)[0].clone() for inputs in calls]
        unparallelize(model)
        parallelize(model, context(ParallelConfig(method="ulysses")), cuda_graph=True)
        graphed, graphs = [], []
        for inputs in calls:
            graphed.append(model(**inputs, return_dict=False)[0].clone())
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        uncompile_blocks(model)
        unparallelize(model)
    return [relative_error(g, e) for g, e in zip(graphed, eager)], graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan"])
def test_compiled_blocks_are_captured_and_replayed_on_one_gpu(family):
    """Nothing compiles once the eager pass has: a compile inside the capture would tune its kernels there,
    which a capture forbids, and one in the warm-up means the capture's guards may fail too."""
    with ProcessPool(1, backend="nccl") as gpu_pool:
        errors, graphs = gpu_pool.run(compiled_in_the_graph, family)[0]
    assert max(errors) <= 2e-2, errors
    assert graphs == [graphs[0]] * len(graphs), graphs

"""`parallelize(..., cuda_graph=True)`: the whole sharded forward replayed from a CUDA graph is bit-identical to
eager, on fresh inputs at every replay and across shapes; on the CPU the flag is refused naming the fix."""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist
from model_cases import COGVIDEOX_CASES, FLUX_CASES, Case, context
from torch.utils._pytree import tree_map_only

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.cli import main as cli_main
from streamfusion_diffusers.diffusers import graphs
from streamfusion_diffusers.diffusers.graphs import set_horizon
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.models.build import build_transformer

GPUS = torch.cuda.device_count()
CASES = {"flux": FLUX_CASES["text-sharded-uneven-image"], "flux-joint": FLUX_CASES["text-joint-batch2"],
         "cogvideox": COGVIDEOX_CASES["rope-text-joint"]}


def _refused() -> str:
    model = build_transformer(CASES["flux"].config)
    try:
        parallelize(model, context(ParallelConfig(method="ulysses")), cuda_graph=True)
    except ValueError as err:
        return str(err)
    return "no error"


def test_cpu_refuses_cuda_graph_naming_the_fix():
    with ProcessPool(2) as pool:
        errors = pool.run(_refused)
    assert all("cuda_graph needs a GPU" in e and "drop --cuda-graph" in e for e in errors), errors


def test_generate_refuses_cuda_graph_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--cpu", "--cuda-graph"])
    assert exit_info.value.code == 2
    assert "drop --cuda-graph" in capsys.readouterr().err


def test_a_forward_that_cannot_be_captured_says_why_in_one_line_naming_the_fix(monkeypatch):
    """On GPUs inductor can tune a compiled kernel at its first launch, which a capture forbids; the capture's own
    error then hides that cause. The CUDA calls around the capture stand in for a GPU here."""
    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    @contextlib.contextmanager
    def capturing(graph: object, stream: object, capture_error_mode: str):
        try:
            yield
        except RuntimeError:  # torch's capture_end fails in turn, while the body's error is handled
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nSearch for ...")

    for name, value in (("current_stream", Stream), ("Stream", Stream), ("stream", lambda s: contextlib.nullcontext()),
                        ("synchronize", lambda: None), ("CUDAGraph", object), ("graph", capturing)):
        monkeypatch.setattr(torch.cuda, name, value)
    calls = []

    def forward() -> None:
        calls.append(1)
        if len(calls) > graphs.WARMUP:  # the warm-up runs; the captured call tunes a kernel
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCompile with ...")

    with pytest.raises(RuntimeError) as caught:
        graphs.capture(forward)
    message = str(caught.value)
    assert "\n" not in message and "--no-cuda-graph" in message and "--compile" in message
    assert message.endswith("what broke the capture: CUDA error: operation not permitted when stream is capturing")


def _cuda_inputs(case: Case, seed: int) -> dict:
    return tree_map_only(torch.Tensor, lambda x: x.cuda().to(torch.bfloat16) if x.is_floating_point() else x.cuda(),
                         case.inputs(seed))


def graph_vs_eager(config: ParallelConfig, case: Case, seed: int, shard_weights: bool = False,
                   streamed: str = "gather") -> list[float]:
    """On every rank: max abs difference between graph replays and eager forwards, over three fresh inputs
    (the first runs eager, the second captures, the third replays) and then a second shape twice (eager, then a
    second capture). shard_weights: each rank holds its shards of the weights, gathered in place inside the
    graph (a sharded model cannot be put back: the eager and the graphed runs each build their own), or its
    streamed blocks run tensor-parallel (streamed="tensor": the token gathers and all-reduces captured)."""
    ctx = context(config)
    grown = Case(case.family, (case.grid[0] + 2, *case.grid[1:]), case.text, case.batch, case.overrides)
    calls = [_cuda_inputs(case, seed + i) for i in range(3)] + [_cuda_inputs(grown, seed + i) for i in (3, 4)]
    diffs = []
    runs = []
    with torch.inference_mode():
        for horizon in (0, None):  # 0: every call eager, the processors a graphed forward runs (no replay pays)
            model = build_transformer(case.config, seed=seed, dtype=torch.bfloat16, device=torch.device("cuda"))
            parallelize(model, ctx, cuda_graph=True, shard_weights=shard_weights, streamed=streamed)
            if horizon is not None:
                set_horizon(model, horizon)
            runs.append([model(**inputs).sample for inputs in calls])
            graphs = len(model._diffusers_hook.get_hook("streamfusion_cuda_graph").graphs)
            if not shard_weights:
                unparallelize(model)
    eager, graphed = runs
    for e, g in zip(eager, graphed):
        diffs.append((e.float() - g.float()).abs().max().item())
    dist.barrier()
    return diffs + [float(graphs)]


@pytest.fixture(scope="module")
def gpu_pool():
    with ProcessPool(GPUS, backend="nccl") as pool:
        yield pool


BACKENDS = ["torch", "symm-pull"] + (["nvshmem"] if importlib.util.find_spec("nvshmem") else [])


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["ulysses", "usp", "torus"])
@pytest.mark.parametrize("case", CASES)
def test_graph_replay_is_bit_identical_to_eager(gpu_pool, case, method, backend):
    config = ParallelConfig(machines=2 if method == "torus" else 1, method=method, backend=backend, strict=True)
    for rank, diffs in enumerate(gpu_pool.run(graph_vs_eager, config, CASES[case], 7)):
        assert diffs[:-1] == [0.0] * 5, f"rank {rank}: {diffs}"
        assert diffs[-1] == 2, f"rank {rank}: expected one graph per shape, got {diffs[-1]}"


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("streamed", ["gather", "tensor"])
def test_sharded_weights_replay_is_bit_identical_to_eager(gpu_pool, streamed):
    """The gathers of sharded weights (into buffers at fixed addresses) captured with the forward; or, blocks
    run tensor-parallel, their token gathers and all-reduces."""
    for rank, diffs in enumerate(gpu_pool.run(graph_vs_eager, ParallelConfig(method="ulysses"), CASES["flux"], 7,
                                              True, streamed)):
        assert diffs[:-1] == [0.0] * 5, f"rank {rank}: {diffs}"
        assert diffs[-1] == 2, f"rank {rank}: expected one graph per shape, got {diffs[-1]}"


def test_a_new_lora_choice_or_precision_never_replays_a_graph_captured_under_another():
    """A graph bakes in the LoRA adapters on and their scaling floats (read on the host while it was captured), and
    the attention kernel of its step (a quantized kernel's native steps run another): `set_variant` and the
    context's `native_now` are part of each graph's key, so the first call under a new choice runs eager, as a
    new shape's does (seen on the CPU: the key decides before any capture)."""
    from types import SimpleNamespace

    from diffusers.hooks import HookRegistry

    from streamfusion_diffusers.diffusers.graphs import GRAPH_HOOK, GraphedForward, set_variant

    model = torch.nn.Linear(4, 4)
    ctx = SimpleNamespace(native_now=False)  # what the key reads of the context (the rest: only a capture)
    hook = GraphedForward(ctx=ctx)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(hook, GRAPH_HOOK)
    x = torch.randn(2, 4)
    for choice in ((("a", 1.0),), (("a", 0.5),), ()):
        set_variant(model, choice)
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    ctx.native_now = True
    model(x)
    assert hook.stats.eager_calls == 4 and hook.stats.captures == 0


def twins_against_stock(config: ParallelConfig, family: str, seed: int) -> float:
    """On every rank: a tiny model of the family parallelized with its processor twins (RoPE in one pass) and
    with the stock processors routed (routing.TWINS emptied), eager, bf16: the largest difference."""
    from plan_cases import Case as PlanCase
    from plan_cases import context as plan_context

    import streamfusion_diffusers.diffusers.routing as routing

    case = PlanCase(family, (6, 5), text=7)
    inputs = tree_map_only(torch.Tensor, lambda x: x.cuda().to(torch.bfloat16) if x.is_floating_point() else x.cuda(),
                           case.inputs(seed + 1))
    outs, twins = [], routing.TWINS
    with torch.inference_mode():
        for chosen in (twins, {}):
            routing.TWINS = chosen
            try:
                model = case.model(seed).to("cuda", torch.bfloat16)
                parallelize(model, plan_context(config))
                outs.append(model(**inputs, return_dict=False)[0].float())
                unparallelize(model)
            finally:
                routing.TWINS = twins
    dist.barrier()
    return (outs[0] - outs[1]).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
@pytest.mark.parametrize("method", ["ulysses", "ring"])
@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_rotary_twins_give_the_stock_processors_output(gpu_pool, family, method):
    """Flux.1's and Flux.2's twins make diffusers' calls step for step with RoPE in one Triton pass: the same
    output, bit for bit, as the stock processors on the same path."""
    for rank, diff in enumerate(gpu_pool.run(twins_against_stock, ParallelConfig(method=method), family, 3)):
        assert diff == 0.0, f"rank {rank}: {diff}"

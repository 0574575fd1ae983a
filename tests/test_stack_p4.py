"""What users stack on a parallelized pipeline, on 4 gloo processes (tiny Flux, float32): a First Block Cache,
TaylorSeer, a LoRA loaded after `parallelize` and torchao int8 weights each give what the same stack gives on one
rank; the First Block Cache's skip decision agrees over the ranks even where their local metrics straddle the
threshold; `generate --cache --lora --quantize` runs and run.json says what ran; bad values are refused in one
line before any process starts."""
from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch
from stack_cases import MODEL, STACKS, compare, latents, make_lora, straddle

from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import MODEL_THRESHOLD, relative_error
from streamfusion_diffusers.diffusers.stack import skips
from streamfusion_diffusers.diffusers.stack.apply import apply_stack
from streamfusion_diffusers.diffusers.stack.spec import Cache, Lora, Stack
from streamfusion_diffusers.models.build import build_pipeline

WORLD = 4
TOL = MODEL_THRESHOLD[torch.float32]
EFFECT = 3 * TOL  # the stack changes the output by more than TOL: a rank that ignored it would fail


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> str:
    return make_lora(tmp_path_factory.mktemp("lora"), seed=1)


@pytest.fixture(scope="module")
def second_lora(tmp_path_factory) -> str:
    return make_lora(tmp_path_factory.mktemp("second-lora"), seed=2)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["first-block", "taylorseer", "lora-after-parallelize", "int8-after-parallelize",
                                  "command-line", "magcache", "pab"])
def test_a_stack_on_four_ranks_gives_what_it_gives_on_one(pool, lora, name):
    args = {"lora-after-parallelize": (lora, 0.8),
            "command-line": (Stack(cache=Cache("first-block", 0.2, 4), loras=(Lora(lora, 0.8),), quantize="int8"),),
            "magcache": (Stack(cache=Cache("magcache", 1.0, 4)),),  # skips every step it may
            "pab": (Stack(cache=Cache("pab", 2, 4)),)}
    stack = name if name in STACKS else "command-line"
    for res in pool.run(compare, stack, args.get(name, ()), 4):
        assert res["error"] <= TOL and res["effect"] >= EFFECT, res


def test_fused_loras_give_what_peft_layers_weighted_by_set_adapters_give(lora, second_lora):
    """The command line fuses its LoRAs into the weights: the same result as diffusers' unfused adapters."""
    scales = (0.8, -0.5)
    fused = build_pipeline(MODEL)
    apply_stack(fused, Stack(loras=(Lora(lora, scales[0]), Lora(second_lora, scales[1]))))
    assert not any("lora" in name for name, _ in fused.transformer.named_modules())  # plain Linear layers again
    layered = build_pipeline(MODEL)
    for name, path in zip("ab", (lora, second_lora)):
        layered.load_lora_weights(path, adapter_name=name)
    layered.set_adapters(["a", "b"], adapter_weights=list(scales))
    want = latents(layered, 2)
    assert relative_error(latents(fused, 2), want) <= TOL
    assert relative_error(latents(build_pipeline(MODEL), 2), want) >= EFFECT


def test_ranks_whose_local_metrics_straddle_the_threshold_skip_together(pool):
    results = pool.run(straddle)
    first = results[0]
    assert min(first["metrics"]) < first["threshold"] < max(first["metrics"]), first  # the slices straddle it
    assert {r["diffusers_computes"] for r in results} == {True, False}, results  # diffusers' per-slice decisions part
    for res in results:
        assert res["calls"] == res["one_rank_calls"] == 1, res  # the second call skipped, on every rank as on one
        assert res["error"] <= TOL, res


def test_a_changed_diffusers_hook_fails_loudly(monkeypatch):
    def decide(self, residual, extra):  # a decision taking another argument than the one read here
        return True

    monkeypatch.setattr(skips.FBCHeadBlockHook, skips.DECISION, decide)
    with pytest.raises(RuntimeError, match="changed its First Block Cache hook"):
        skips.check_hook()


def test_the_command_line_stack_runs_and_run_json_says_what_ran(pool, lora, tmp_path):
    job = generate.make_job(_args("--model", MODEL, "--steps", "2", "--cache", "first-block:0.2", "--lora",
                                  f"{lora}:0.8", "--quantize", "int8", "--output", str(tmp_path)))
    answers = pool.run(worker.generate, job)
    records = [generate.write_outputs(job, answers[0]), *answers[1:]]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run == records[0], run
    assert run["stack"] == {"lora": [{"path": lora, "scale": 0.8}], "cache": "first-block:0.2",
                            "quantize": "int8 weight-only (torchao Int8WeightOnlyConfig)"}, run["stack"]
    assert run["attention_precision"] == {"attention": "native"}, run["attention_precision"]


@pytest.mark.parametrize(("argv", "message"), [
    (("--cache", "deepcache"), "unknown cache 'deepcache'; one of first-block, taylorseer, magcache, pab"),
    (("--cache", "first-block:-1"), "the threshold must be a number above 0"),
    (("--cache", "taylorseer:2.5"), "the interval must be an integer at least 1"),
    (("--model", "tiny-wan", "--cache", "magcache"), "Flux.1 only"),
    (("--lora", "no/such/lora.safetensors"), "no such file or folder"),
    (("--lora", "LORA:abc"), "the scale 'abc' is not a finite number"),
    (("--lora", "LORA:nan"), "the scale 'nan' is not a finite number"),
    (("--quantize", "fp8"), "--quantize fp8 needs a GPU of compute capability 8.9"),
    (("--quantize", "fp8-dynamic"), "--quantize fp8-dynamic needs a GPU of compute capability 8.9"),
    (("--attention", "int8"), "--attention int8 needs triton, a GPU of compute capability 8.0 or newer"),
    (("--attention", "fp8"), "--attention fp8 needs triton, a GPU of compute capability 8.9 or newer"),
    (("--lora", "my style=LORA"), "the name 'my style' must be 1 to 64 letters, digits"),
    (("--lora", "a=LORA", "--lora", "a=LORA:2"), "--lora a=...: the name is given twice"),
    (("--lora", "a=LORA", "--quantize", "int8"), "--quantize int8 with named LoRAs (--lora NAME=PATH) is not"),
    (("--lora", "a=LORA", "--compile"), "--compile with named LoRAs (--lora NAME=PATH) is not supported"),
])
def test_bad_values_are_refused_in_one_line_before_any_process_starts(lora, argv, message, capsys):
    if torch.cuda.is_available() and ("fp8" in argv or "int8" in argv[:2] and argv[0] == "--attention"):
        pytest.skip("a GPU is visible: fp8 may be allowed here")
    argv = [a.replace("LORA", lora) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_missing_torchao_or_peft_names_the_extra_to_install(monkeypatch, lora):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in ("torchao", "peft") else real(name, *args))
    with pytest.raises(ValueError, match=r'--quantize int8 needs torchao: pip install -e "\.\[quantize\]"'):
        generate.make_job(_args("--quantize", "int8"))
    with pytest.raises(ValueError, match=r'--lora needs peft: pip install -e "\.\[lora\]"'):
        generate.make_job(_args("--lora", lora))


def test_a_cache_with_a_cuda_graph_is_refused():
    with pytest.raises(ValueError, match="drop --cuda-graph or --cache"):
        generate.make_job(_args("--cache", "first-block", "--cuda-graph"))


def test_quantized_attention_steps_native_first_and_last():
    """--attention int8|fp8: the schedule's first and last steps give the kernel back to the per-call choice."""
    from types import SimpleNamespace

    from streamfusion_diffusers import ParallelConfig
    from streamfusion_diffusers.context import ParallelContext

    ctx = SimpleNamespace(config=ParallelConfig(kernel="int8", native_steps=(1, 2)), native_now=False)
    kernels = []
    for step in range(6):
        ParallelContext.attention_step(ctx, step, 6)
        kernels.append(ParallelContext.kernel_now(ctx, "int8"))
    assert kernels == ["auto", "int8", "int8", "int8", "auto", "auto"], kernels
    assert ParallelContext.kernel_now(ctx, "sdpa") == "sdpa"
    with pytest.raises(ValueError, match="native_steps must be two non-negative integers"):
        ParallelConfig(kernel="int8", native_steps=(1, -1))

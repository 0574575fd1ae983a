"""Whether a job compiles its blocks when `--compile` is not given: from the measured steps of
choice/recipes/compiled.json (each read from its log here), over the job's steps (`generate`; `serve` only when
asked); only what was measured compiles by default, and run.json says why."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from streamfusion_diffusers.choice import compiling
from streamfusion_diffusers.choice.compiling import compile_pays, nearest, records
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.runtime.arguments import add_arguments
from streamfusion_diffusers.runtime.job import make_job

ROOT = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
# generate's summary line: model, ranks, the median step after the first, and the first step
SUMMARY = re.compile(r"streamfusion generate: (\S+) on (\d+) ranks .*?, ([\d.]+) ms/step after the first \(([\d.]+) s")
GPU = (1, 4, True)  # one machine of 4 GPUs, as the record's


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "flux-dev", "--height", "1024", "--width", "1024", *argv])


def test_every_record_is_its_log():
    for r in records():
        runs = [m.groups() for m in SUMMARY.finditer((ROOT / r.record).read_text())]
        (model, ranks, graph_ms, graph_first), (model2, ranks2, compiled_ms, compiled_first) = (runs[i] for i in r.lines)
        assert model == model2 == r.model and int(ranks) == int(ranks2) == r.ranks
        assert r.tokens == MODELS[r.model].image_tokens(r.height, r.width, r.frames)
        assert (r.graph_step_s, r.compiled_step_s) == pytest.approx((float(graph_ms) / 1e3, float(compiled_ms) / 1e3),
                                                                    abs=1e-4)
        assert r.compile_s == pytest.approx(float(compiled_first) - float(graph_first), abs=0.01)


def test_a_compile_pays_over_enough_steps_and_never_by_default_in_a_server():
    record = nearest("flux-dev", 4096, 4)
    assert record is not None and record.ranks == 4 and record.saving_s > 0
    pays, why = compile_pays("flux-dev", 4096, 4, 7)
    assert not pays and "less than the compile" in why and "--compile" in why
    enough = int(record.compile_s / record.saving_s) + 1
    assert compile_pays("flux-dev", 4096, 4, enough)[0] and not compile_pays("flux-dev", 4096, 4, enough - 2)[0]
    pays, why = compile_pays("flux-dev", 4096, 4, None)
    assert not pays and "a server would wait for the compile" in why and "--compile" in why


def test_the_nearest_record_is_by_the_tokens_a_rank_holds_and_its_saving_scales_with_them():
    one = nearest("flux-dev", 4096, 1)
    assert one.ranks == 1 and nearest("flux-dev", 4 * 4096, 4) == one  # a rank holds what one GPU held
    half = nearest("flux-dev", 2048, 1)  # no record at 2048 tokens: the one at 4096, its saving halved
    assert half == one
    calls = int(one.compile_s / one.saving_s) + 1  # pays at 4096 tokens a rank, not at half of them
    assert compile_pays("flux-dev", 4096, 1, calls)[0] and not compile_pays("flux-dev", 2048, 1, calls)[0]


def test_a_model_without_a_record_does_not_compile(monkeypatch):
    pays, why = compile_pays("qwen-image", 6889, 4, None)
    if nearest("qwen-image", 6889, 4) is None:
        assert not pays and "no compiled step of qwen-image measured" in why
    slower = compiling.CompiledRecord("tiny", 64, 64, 1, 1, 16, "H100", 0.1, 0.11, 5.0, "x.log", (0, 1))
    monkeypatch.setattr(compiling, "records", lambda: (slower,))
    pays, why = compile_pays("tiny", 16, 1, None)
    assert not pays and "no faster" in why


@pytest.mark.parametrize("argv, serving, on, words", [
    ((), False, False, "less than the compile"),  # 28 steps of flux-dev 1024 at P = 4
    ((), True, False, "a server would wait for the compile"),
    (("--steps", "100000"), False, True, "more than the compile"),
    (("--no-compile",), False, False, "--no-compile"),
    (("--compile",), True, True, "asked for"),
    (("--compile",), False, True, "asked for"),
    (("--no-cuda-graph", "--steps", "100000"), False, False, "CUDA graphs off"),
    (("--emulate-link", "p4de", "--steps", "100000"), False, False, "--emulate-link"),
])
def test_the_choice_and_why_of_a_job_on_gpus(argv, serving, on, words):
    shape = (2, 2, True) if "--emulate-link" in argv else GPU
    job = make_job(_args(*argv), shape, serving=serving)
    assert job.compile is on and words in job.compile_why, job.compile_why


def test_on_the_cpu_nothing_compiles_unless_asked():
    job = make_job(_args("--model", "tiny-flux", "--height", "64", "--width", "64"), (1, 2, False), serving=True)
    assert not job.compile and "no GPU" in job.compile_why


def test_a_compiled_server_warms_up_every_size_at_every_batch_kind_it_may_run():
    """serve --compile makes each warm size with one image and with the planner's largest batch before it says
    ready: dynamo compiles a batch of one apart from larger ones, the larger with the batch size symbolic."""
    from streamfusion_diffusers.serve.warm import check_sizes, warm_shapes

    compiled = make_job(_args("--compile"), GPU, serving=True)
    sizes = check_sizes(compiled, None)
    assert sizes == ((1024, 1024),)  # the model's own size by default
    assert warm_shapes(compiled, sizes, 8) == ((1024, 1024, 1), (1024, 1024, 8))
    assert warm_shapes(compiled, ((1024, 1024), (768, 1344)), 4) == \
        ((1024, 1024, 1), (1024, 1024, 4), (768, 1344, 1), (768, 1344, 4))
    assert warm_shapes(compiled, sizes, 1) == ((1024, 1024, 1),)  # every request alone: no batch to warm
    assert warm_shapes(make_job(_args(), GPU, serving=True), sizes, 8) == ((1024, 1024, 1),)  # eager blocks
    assert compiled.compile_cache and compiled.compile_cache.endswith("inductor")
    with pytest.raises(ValueError, match="multiples of 16"):
        check_sizes(compiled, ((1000, 1024),))
    with pytest.raises(ValueError, match="add --compile or drop --compile-cache"):
        make_job(_args("--no-compile", "--compile-cache", "/tmp/x"), GPU, serving=True)

"""`streamfusion plan` for every model generate runs, and `plan --memory`'s per-GPU estimate (models/memory.py)
against the peaks measured on GPUs (benchmarks/plan_memory_check.py: the one-GPU pipelines of Qwen-Image, Flux.2-dev
and Wan 2.2 A14B, Flux.1-dev's transformer step); sharded weights cut what a rank holds by P."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from streamfusion_diffusers.commands import plan
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.models.memory import GIB, estimate

ROOT = Path(__file__).resolve().parent.parent
WITHIN = 0.05  # relative, estimate against a measured peak


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_takes_every_model_generate_runs(model, capsys):
    assert plan.main(_args("--machines", "1", "--gpus-per-machine", "4", "--model", model)) == 0
    assert "recommended:" in capsys.readouterr().out


def test_the_estimate_meets_the_measured_peaks(tmp_path):
    """benchmarks/plan_memory_check.py: the pipelines' one-GPU peaks and Flux.1-dev's step, within WITHIN."""
    out = tmp_path / "check.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_memory_check.py"), "--out", str(out)], check=True,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(abs(r["planned_over_measured"] - 1) <= WITHIN for r in rows), rows


def test_sharding_divides_the_held_weights_and_fits_smaller_gpus(capsys):
    whole, sharded = (estimate("flux2-dev", 1024, 1024, 1, 4, sharded=s) for s in (False, True))
    assert sharded.peak < 40e9 / GIB < whole.peak and 40 in sharded.fits and 40 not in whole.fits
    assert plan.main(_args("--machines", "1", "--gpus-per-machine", "4", "--model", "flux2-dev", "--memory",
                           "--streamed-blocks", "gather", "--json")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["sharded"] for r in rows] == [False, True] and rows[1]["peak"] == pytest.approx(sharded.peak)


@pytest.mark.parametrize("model", sorted(m for m in MODELS if m.startswith("tiny-")))  # one of each family
def test_plan_memory_takes_every_family(model, capsys):
    assert plan.main(_args("--machines", "1", "--gpus-per-machine", "4", "--model", model, "--memory")) == 0
    assert "sharded" in capsys.readouterr().out


def test_an_edit_counts_its_input_images_tokens():
    """Qwen-Image-Edit and Kontext pack the input image's latents into the split sequence: more activations than
    their base model's at the same size, the same weights."""
    for edit, base in (("tiny-qwen-image-edit", "tiny-qwen-image"), ("tiny-flux-kontext", "tiny-flux")):
        e, b = (estimate(m, 512, 512, 1, 2) for m in (edit, base))
        assert e.activations > 1.5 * b.activations and e.attention > 1.5 * b.attention, (e, b)


def test_plan_and_plan_memory_need_no_machines(capsys):
    """One machine unless --machines says otherwise: `plan --model flux-dev` and `plan --memory` as typed."""
    assert plan.main(_args("--model", "flux-dev")) == 0
    assert "on 1 x 8 GPUs" in capsys.readouterr().out
    assert plan.main(_args("--memory")) == 0
    assert "on 1 x 8 GPUs" in capsys.readouterr().out


@pytest.mark.parametrize("model, ranks, gib", [("flux-dev", 4, 79.2), ("flux-dev", 1, 79.2), ("wan2.2-t2v-a14b", 4, 139.8)])
def test_the_largest_admitted_size_fits_and_one_step_more_does_not(model, ranks, gib):
    """What a server admits by default on GPUs: the planner's peak at the largest square fits the GPU beside the
    runtime's share, one size step more does not; likewise the frames of a video model at its own size."""
    from streamfusion_diffusers.models import MODELS
    from streamfusion_diffusers.models.memory import RUNTIME_GIB, estimate, largest_size

    spec = MODELS[model]
    pixels, frames = largest_size(model, ranks, gib)
    side = int(pixels ** 0.5)
    at = spec.frames
    assert side % spec.size_step == 0 and side >= spec.height
    assert estimate(model, side, side, at, ranks).peak + RUNTIME_GIB <= gib
    bigger = side + spec.size_step
    assert estimate(model, bigger, bigger, at, ranks).peak + RUNTIME_GIB > gib
    if spec.video:
        assert (frames - 1) % spec.temporal == 0 and frames >= spec.frames
        assert estimate(model, spec.height, spec.width, frames, ranks).peak + RUNTIME_GIB <= gib
        more = frames + spec.temporal
        assert estimate(model, spec.height, spec.width, more, ranks).peak + RUNTIME_GIB > gib
    else:
        assert frames == 0


@pytest.mark.parametrize(("model", "side", "chosen"), [("flux2-dev", 1024, "tensor"), ("flux-dev", 4096, "gather"),
                                                       ("wan2.2-ti2v-5b", 704, "gather")])
def test_streamed_blocks_auto_takes_the_fewer_bytes(model, side, chosen, capsys):
    """At image sizes a tensor-parallel block's token rows are fewer bytes than its weights; at 4096 px the tokens
    outweigh them; a model without a tensor-parallel plan (Wan) gathers. plan --memory names the choice."""
    from streamfusion_diffusers.models.memory import streamed_choice

    frames = MODELS[model].frames
    assert streamed_choice(model, side, side, frames, 4) == chosen
    for default in ((), ("--streamed-blocks", "auto")):  # auto is the default
        plan.main(_args("--model", model, "--memory", "--gpus-per-machine", "4", "--resolution", str(side),
                        *default))
        assert ("(tensor-parallel)" in capsys.readouterr().out) == (chosen == "tensor")


def test_a_split_that_keeps_every_part_whole_streams_nothing():
    """flux2-dev's whole pipeline (24B text encoder, 32B transformer) fits an H200's 130 GiB free beside a step at
    P = 2, so `--shard-weights` there has nothing to shard and the job builds as without it (runtime/build.py);
    an H100's 72 GiB streams blocks of both."""
    roomy, tight = (estimate("flux2-dev", 1024, 1024, 1, 2, sharded=True, max_memory=gib) for gib in (130.0, 72.0))
    assert not roomy.streams and roomy.split == "whole: text_encoder, transformer" and roomy.peak < 130
    assert tight.streams and "kept" in tight.split


def test_a_sharded_start_that_would_exhaust_host_memory_is_refused_in_one_line():
    """Random weights are made whole on every rank and parked in host memory before sharding: flux2-dev's 105 GiB
    per rank, 4 ranks on 80 GB GPUs, need about 420 GiB; refused where less is available, started where more is,
    and nothing is parked where the whole pipeline fits the GPUs (141 GB: nothing to shard)."""
    from streamfusion_diffusers import ParallelConfig
    from streamfusion_diffusers.runtime.job import check_host_memory

    size = ("flux2-dev", 1024, 1024, 1, 4, ParallelConfig(), None)
    with pytest.raises(ValueError, match=r"4 ranks of this machine .* about 4\d\d GiB in all, and 300 GiB"):
        check_host_memory(*size, available=300.0, gpu_gib=74.5, local=4)
    check_host_memory(*size, available=500.0, gpu_gib=74.5, local=4)
    check_host_memory(*size, available=300.0, gpu_gib=131.0, local=4)


def test_plan_memory_says_what_a_sharded_start_parks_in_host_memory(capsys):
    plan.main(_args("--model", "flux2-dev", "--memory", "--gpus-per-machine", "4"))
    line = next(x for x in capsys.readouterr().out.splitlines() if "start-up with random weights" in x)
    assert "(104.9 GiB)" in line and "420 GiB per machine" in line


def test_a_size_that_does_not_fit_this_machine_is_refused_before_any_rank_starts_saying_what_fits():
    """generate --height 100000 --width 100000 on the CPU: one line from the estimate, with the largest square
    whose estimate fits what is available, instead of four ranks failing on an allocation."""
    import dataclasses
    import math

    from streamfusion_diffusers.cli import make_parser
    from streamfusion_diffusers.models.memory import largest_size, pipeline_parts
    from streamfusion_diffusers.runtime.job import check_memory, make_job

    args = make_parser().parse_args(["generate", "--model", "tiny-flux", "--cpu"])
    job = make_job(args)
    check_memory(job, available_gib=8.0)  # the default size fits
    with pytest.raises(ValueError) as refused:
        check_memory(dataclasses.replace(job, height=100000, width=100000), available_gib=8.0)
    side = math.isqrt(largest_size("tiny-flux", 4, 2.0, dtype=torch.float32, runtime_gib=0.0)[0])
    assert 64 <= side < 100000
    message = str(refused.value)
    assert message.startswith("100000x100000: tiny-flux needs about ") and "and 8.0 GiB is available" in message
    assert message.endswith(f"at most {side}x{side} fits"), message
    fitting = dataclasses.replace(job, height=side, width=side)
    check_memory(fitting, available_gib=8.0)
    parts = pipeline_parts("tiny-flux", torch.float32)
    assert 4 * estimate("tiny-flux", side, side, 1, 4, parts=parts, bytes_per_value=4).peak <= 8.0

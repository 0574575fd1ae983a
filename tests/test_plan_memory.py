"""`streamfusion plan` for every model generate runs, and `plan --memory`'s per-GPU estimate (models/memory.py)
against the peaks measured on one GPU (benchmarks/results/): the whole pipelines of Qwen-Image, Flux.2-dev and
Wan 2.2 A14B, Flux.1-dev's transformer step; sharded weights cut what a rank holds by P."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from streamfusion_diffusers.commands import plan
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.models.memory import GIB, estimate, pipeline_parts

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
WITHIN = 0.05  # relative, estimate against a measured peak


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_takes_every_model_generate_runs(model, capsys):
    assert plan.main(_args("--machines", "1", "--gpus-per-machine", "4", "--model", model)) == 0
    assert "recommended:" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["qwen-image", "flux2-dev", "wan2.2-t2v-a14b"])
def test_the_estimate_meets_the_measured_one_gpu_pipeline_peaks(model):
    run = json.loads((RESULTS / "2026-11-24-h200-new-models" / f"{model}.run.json").read_text())
    got = estimate(model, run["height"], run["width"], run["frames"] or 1, run["world_size"]).peak
    assert abs(got / run["peak_memory_gib"] - 1) <= WITHIN, (got, run["peak_memory_gib"])


def test_the_estimate_meets_flux_devs_measured_transformer_step():
    rows = json.loads((RESULTS / "2026-11-22-h200x2" / "step-flux-dev-2048" / "results.json").read_text())["rows"]
    measured = max(r["peak_gib"] for r in rows if r["method"] == "ulysses")  # 2 GPUs, the step alone
    e = estimate("flux-dev", 2048, 2048, 1, 2)
    got = pipeline_parts("flux-dev")["transformer"].total / GIB + e.activations + e.attention
    assert abs(got / measured - 1) <= WITHIN, (got, measured)


def test_sharding_divides_the_held_weights_and_fits_smaller_gpus(capsys):
    whole, sharded = (estimate("flux2-dev", 1024, 1024, 1, 4, sharded=s) for s in (False, True))
    assert sharded.peak < 40e9 / GIB < whole.peak and 40 in sharded.fits and 40 not in whole.fits
    assert plan.main(_args("--machines", "1", "--gpus-per-machine", "4", "--model", "flux2-dev", "--memory",
                           "--json")) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["sharded"] for r in rows] == [False, True] and rows[1]["peak"] == pytest.approx(sharded.peak)

"""Two-wave blocks (`parallelize(..., waves=2)`) give the one-wave output, on tiny Flux and CogVideoX over 4 gloo
processes: the pure-Ulysses path (attention per wave of queries) and the Torus-schedule path, text tokens split
or replicated, uneven slices. Also the wave-size rule and bad `waves` values."""
from __future__ import annotations

import pytest
import torch
from model_cases import COGVIDEOX_CASES, FLUX_CASES, TOL, Case, context

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.commands.spawn import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.waves import TILE_ROWS, auto_waves, wave_sizes
from streamfusion_diffusers.models.build import build_transformer

WORLD = 4
CASES = {"flux-text-sharded": FLUX_CASES["text-sharded-uneven-image"], "flux-text-joint": FLUX_CASES["text-joint-batch2"],
         "cogvideox-rope-joint": COGVIDEOX_CASES["rope-text-joint"]}
CONFIGS = {"ulysses-1x4": ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses"),
           "usp-2x2": ParallelConfig(machines=2, gpus_per_machine=2, method="usp"),
           "torus-2x2": ParallelConfig(machines=2, gpus_per_machine=2, method="torus"),
           "auto-2x2": ParallelConfig(machines=2, gpus_per_machine=2, method="auto")}  # chooses inside the waves


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def waves_vs_one(config: ParallelConfig, case: Case, seed: int) -> dict:
    """On every rank: the waves=2 output against waves=1 and the unparallelized one, and the row counts the first
    block's Q projection saw (two calls of about half the rows each when the waves are really cut)."""
    model = build_transformer(case.config, seed=seed)
    inputs = case.inputs(seed + 1)
    first = model.transformer_blocks[0]
    q_proj = first.attn.to_q if hasattr(first, "attn") else first.attn1.to_q
    rows: list[int] = []
    q_proj.register_forward_pre_hook(lambda _m, a: rows.append(a[0].shape[1]))
    outs = {}
    with torch.no_grad():
        reference = model(**inputs).sample
        for waves in (2, 1):  # two waves first: method auto must choose inside the waves
            rows.clear()
            parallelize(model, context(config), waves=waves)
            outs[waves] = model(**inputs).sample
            outs[f"rows{waves}"] = list(rows)
            unparallelize(model)
    return {"vs_one_wave": relative_error(outs[2], outs[1]), "vs_reference": relative_error(outs[2], reference),
            "rows1": outs["rows1"], "rows2": outs["rows2"]}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("config", CONFIGS)
def test_two_waves_match_one_wave(pool, config, case):
    for res in pool.run(waves_vs_one, CONFIGS[config], CASES[case], seed=3):
        assert res["vs_one_wave"] <= 1e-5, res
        assert res["vs_reference"] <= TOL, res
        assert len(res["rows1"]) == 1 and len(res["rows2"]) == 2, res
        assert abs(res["rows2"][0] - res["rows2"][1]) <= max(res["rows1"][0] // 2, 2), res


def test_wave_sizes_cut_on_gemm_tiles():
    assert wave_sizes(10, 2) == [5, 5] and wave_sizes(7, 2) == [4, 3]
    assert wave_sizes(1100, 2) == [512, 588]  # 8 tiles: 4 + 4, the ragged rest in the last wave
    assert wave_sizes(5 * TILE_ROWS, 2) == [3 * TILE_ROWS, 2 * TILE_ROWS]
    assert sum(wave_sizes(4321, 3)) == 4321


def test_auto_waves_keeps_small_shares_whole():
    # Flux 1024 px on 8 H200s (132 SMs): 4608 / 8 = 576 rows, width 3072 -> 3 x 24 tiles per half: 1 wave
    assert auto_waves(576, 3072, 132) == 1
    assert auto_waves(16896 // 4, 3072, 132) == 2
    assert auto_waves(10, 16, 0) == 2  # the CPU (no SMs) never idles SMs


def test_bad_waves_are_refused(pool):
    errors = pool.run(_bad_waves)
    assert all("waves must be a positive integer or 'auto'" in e for e in errors), errors


def _bad_waves() -> str:
    model = build_transformer(CASES["flux-text-sharded"].config)
    try:
        parallelize(model, context(CONFIGS["ulysses-1x4"]), waves=0)
    except ValueError as err:
        return str(err)
    return "no error"

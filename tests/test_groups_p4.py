"""Groups smaller than the job, on 4 gloo processes: every rank talks only inside its context's groups.

Two worlds in one job (`init_parallel(..., worlds=[[0, 1], [2, 3]])`, as xDiT places its CFG branches and
data-parallel copies), each generating its own prompt and seed: each gets its own image exactly, the VAE decode
included (it is shared over the world, not the job). And the CFG split (cfg=2: two branches of 2 ranks in one
context): the branches hold the same latents, and the whole job decodes them. Tiny Flux, Wan and Qwen-Image
pipelines, float32, against the unparallelized pipeline on the same rank.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from model_cases import TOL

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.models.build import build_pipeline

WORLD = 4
WORLDS = [[0, 1], [2, 3]]
PROMPTS = ("a red cat under a blue sky", "a green boat on a grey sea")
# guided where the pipeline can be (two transformer calls per step: the CFG split pairs them)
GUIDED = {"tiny-flux": dict(true_cfg_scale=4.0, negative_prompt="blurry"),
          "tiny-wan": dict(num_frames=5, guidance_scale=5.0),
          "tiny-qwen-image": dict(true_cfg_scale=4.0, negative_prompt="blurry")}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _generate(pipe: Any, name: str, prompt: str, seed: int) -> torch.Tensor:
    out = pipe(prompt=prompt, height=64, width=64, num_inference_steps=2, output_type="pt",
               generator=torch.Generator().manual_seed(seed), **GUIDED[name])
    return out.frames if name == "tiny-wan" else out.images


def _own_image(name: str, config: ParallelConfig, worlds: list[list[int]] | None) -> dict:
    """On every rank: its world's image (prompt and seed of its own) unparallelized and parallelized."""
    world = dist.get_rank() // 2 if worlds else 0
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    reference = _generate(pipe, name, PROMPTS[world], world)
    ctx = init_parallel(config, worlds=worlds)
    transformer = parallelize(pipe, ctx)
    vae_decode = transformer._streamfusion.vae_decode
    out = _generate(pipe, name, PROMPTS[world], world)
    unparallelize(pipe)
    return {"world": world, "error": relative_error(out, reference), "vae_decode": vae_decode,
            "cfg": ctx.cfg.degree, "reference": reference}


@pytest.mark.parametrize("name", sorted(GUIDED))
def test_two_worlds_in_one_job_each_get_their_own_image(pool, name):
    config = ParallelConfig(machines=1, gpus_per_machine=2, method="ulysses")
    results = pool.run(_own_image, name, config, WORLDS)
    assert [r["world"] for r in results] == [0, 0, 1, 1]
    for res in results:
        assert res["vae_decode"] == "patch-parallel" and res["error"] <= TOL, {**res, "reference": None}
    # the two worlds made different images (else a decode over the whole job could pass unnoticed)
    assert relative_error(results[2]["reference"], results[0]["reference"]) > 1e-2


@pytest.mark.parametrize("name", sorted(GUIDED))
def test_the_cfg_split_decodes_over_the_whole_job(pool, name):
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", cfg=2)
    for res in pool.run(_own_image, name, config, None):
        assert res["cfg"] == 2 and res["vae_decode"] == "patch-parallel", res
        assert res["error"] <= TOL, {**res, "reference": None}

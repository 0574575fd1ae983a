"""Whole tiny pipelines (4 gloo processes): the same image / video with and without parallelization, and the
`streamfusion generate` job writing its output and run.json; bad layouts fail before any process starts."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize
from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import startup, worker
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.vae.tiles import is_split
from streamfusion_diffusers.models.build import build_pipeline

WORLD = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _pipeline_outputs(name: str, config: ParallelConfig) -> dict:
    """On every rank: the tiny pipeline's output unparallelized, then parallelized, and the tokens a block held."""
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt="a red cat under a blue sky", height=64, width=64, num_inference_steps=2, output_type="np")
    if name == "tiny-cogvideox":
        kwargs["num_frames"] = 9
    seen: list[int] = []
    block = pipe.transformer.transformer_blocks[0]  # its attention sees the tokens as the plan cut them
    (block.attn1 if hasattr(block, "attn1") else block.attn).register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)

    def run() -> np.ndarray:
        out = pipe(generator=torch.Generator().manual_seed(0), **kwargs)
        return out.images if name == "tiny-flux" else out.frames

    # untiled reference: parallelize decodes patch-parallel, exactly (tiling on would be ignored there)
    reference = run()
    full_tokens = seen[-1]
    parallelize(pipe, init_parallel(config))
    out = run()
    return {"error": relative_error(torch.from_numpy(out), torch.from_numpy(reference)),
            "full_tokens": full_tokens, "block_tokens": seen[-1], "rank": dist.get_rank(),
            "vae_split": is_split(pipe.vae)}


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-cogvideox"])
def test_pipeline_output_is_the_same_parallelized(pool, name):
    config = ParallelConfig(machines=2, gpus_per_machine=2, method="torus")
    for res in pool.run(_pipeline_outputs, name, config):
        assert res["block_tokens"] == res["full_tokens"] // WORLD, res
        assert res["error"] <= TOL and res["vae_split"], res


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_writes_the_image_and_run_json(pool, tmp_path):
    job = generate.make_job(_args("--steps", "3", "--output", str(tmp_path)))
    assert job.world_size == WORLD and job.parallel.method == "auto" and job.parallel.machines == 2
    answers = pool.run(worker.generate, job)
    records = [generate.write_outputs(job, answers[0]), *answers[1:]]
    assert records[1:] == [None] * (WORLD - 1)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run == records[0]
    assert run["layout"].split()[1] == "2x2" and len(run["step_latency_s"]) == 3
    assert [a["layout"] for a in run["attention"]] == [run["layout"]]  # what ran, and why:
    assert "cost model" in run["attention"][0]["why"]  # no recipe entry for tiny-flux
    assert run["backend"] == "torch over gloo" and run["output_size"] == {"height": 64, "width": 64}
    assert all(t > 0 for t in run["step_latency_s"]) and run["total_s"] >= sum(run["step_latency_s"])
    once = run["one_time_s"]  # the first step's one-time work, by kind (kernels are timed on GPUs only)
    assert {"layout choice", "process groups"} <= once.keys() and 0 < sum(once.values()) < run["generate_s"]
    assert "build" in run["startup_s"] and set(run["startup_s"]) <= set(startup.STAGES)  # (a pool built before:
    assert 0 < sum(run["startup_s"].values()) < 600  # its process and join were another build's)
    assert Path(run["outputs"][0]).name == "image.png" and (tmp_path / "image.png").stat().st_size > 0


def test_generate_video_writes_frames_or_a_video(pool, tmp_path):
    job = generate.make_job(_args("--model", "tiny-cogvideox", "--method", "usp", "--steps", "2",
                                  "--output", str(tmp_path)))
    run = generate.write_outputs(job, pool.run(worker.generate, job)[0])
    assert run["frames"] == 9 and run["layout"].startswith("usp")
    assert all(Path(p).is_file() for p in run["outputs"])
    assert len(run["outputs"]) in (1, 9)  # video.mp4, or one PNG per frame without an encoder


@pytest.mark.parametrize(("argv", "message"), [
    (("--method", "ulysses", "--machines", "1", "--gpus-per-machine", "16", "--model", "flux-dev", "--cpu"),
     "does not divide the 24 heads"),
    (("--method", "torus", "--ulysses", "3"), "does not divide 4 ranks; valid ulysses degrees"),
    (("--height", "4", "--width", "4"), "raise --height/--width"),
    (("--recipe", "flux-dev", "--method", "torus"), "--recipe is what --method auto reads"),
    (("--ulysses", "2",), "method 'auto' chooses ulysses"),
    (("--recipe", "nowhere.yaml",), "no recipe 'nowhere.yaml'"),
])
def test_generate_bad_layouts_fail_before_any_work(argv, message):
    with pytest.raises(ValueError, match=message):
        generate.main(_args(*argv))

"""CFG parallelism over 4 gloo processes (2 guidance branches x SP 2): the same video and noise predictions as
one process, each branch's attention groups inside its half of the machines, and the branch placement rules."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.hooks import HookRegistry
from model_cases import COGVIDEOX_CASES, FLUX_CASES, TOL, Case
from plan_cases import Case as PlanCase

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.config import cfg_shape
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.core.mesh import cfg_branches
from streamfusion_diffusers.diffusers.cfg import CFG_HOOK
from streamfusion_diffusers.models.build import build_pipeline, build_transformer
from streamfusion_diffusers.models.configs import MODELS
from streamfusion_diffusers.models.pipelines import family_of

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def test_branches_span_machines_when_they_can():
    assert cfg_branches(2, 2, 2) == ((0, 1), (2, 3))  # one branch per machine
    assert cfg_branches(4, 2, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))  # one branch per half of the machines
    assert cfg_branches(1, 4, 2) == ((0, 1), (2, 3))  # one machine: each branch on half of it
    assert cfg_branches(3, 2, 2) == ((0, 2, 4), (1, 3, 5))  # odd machine count: half of every machine
    assert cfg_branches(2, 2, 1) == ((0, 1, 2, 3),)
    assert cfg_shape(4, 8, 2) == (2, 8) and cfg_shape(3, 8, 2) == (3, 4)
    with pytest.raises(ValueError, match="even number of machines or of GPUs per machine"):
        cfg_shape(3, 1, 2)
    with pytest.raises(ValueError, match="cfg must be 1, 2 or 'auto'"):
        ParallelConfig(cfg=4)


GUIDED = {"tiny-cogvideox": dict(num_frames=9, guidance_scale=6.0),  # one call of batch [uncond ; cond]
          "tiny-flux": dict(true_cfg_scale=4.0, negative_prompt="blurry")}  # two calls of batch 1


def _pipeline(config: ParallelConfig, name: str = "tiny-cogvideox", guided: bool = True) -> dict:
    """On every rank: a tiny pipeline (guided: two branches per step) unparallelized and parallelized, the batch
    and tokens a block held, the transformer calls per step, and the ranks of this rank's attention groups."""
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    seen: list[tuple[int, int]] = []
    block = pipe.transformer.transformer_blocks[0]  # its attention sees the tokens as the plan cut them
    (block.attn1 if hasattr(block, "attn1") else block.attn).register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["hidden_states"].shape[:2])), with_kwargs=True)
    kwargs = GUIDED[name] if guided else {"num_frames": 9} if name == "tiny-cogvideox" else {}
    # untiled reference: parallelize decodes patch-parallel, exactly (tiling on would be ignored there)

    def run() -> np.ndarray:
        out = pipe(prompt="a red cat under a blue sky", height=64, width=64, num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
        return out.frames if name == "tiny-cogvideox" else out.images

    reference = run()
    full, calls = seen[-1], len(seen)
    ctx = init_parallel(config)
    parallelize(pipe, ctx)
    out = run()
    calls = (calls, len(seen) - calls)
    unparallelize(pipe)
    mesh = ctx.mesh(pipe.transformer.config.num_attention_heads)
    groups = {g.name: g.ranks for g in (mesh.torus, mesh.ulysses_intra, mesh.ring, mesh.world)}
    return {"error": relative_error(torch.from_numpy(out), torch.from_numpy(reference)), "full": full,
            "block": seen[-1], "calls": calls, "restored": type(pipe.scheduler).step is pipe.scheduler.step.__func__,
            "cfg": ctx.cfg.degree, "groups": groups, "rank": dist.get_rank()}


@pytest.mark.parametrize(("method", "cfg"), [("torus", 2), ("usp", "auto")])
def test_cogvideox_pipeline_with_cfg_parallel_is_exact(pool, method, cfg):
    config = ParallelConfig(machines=2, gpus_per_machine=2, method=method, cfg=cfg)
    for res in pool.run(_pipeline, config):
        assert res["cfg"] == 2, res
        assert res["full"][0] == 2 and res["block"][0] == 1, res  # one guidance branch per half
        assert res["block"][1] in (res["full"][1] // 2, res["full"][1] // 2 + 1), res  # SP 2 inside the branch
        branch = (0, 1) if res["rank"] < 2 else (2, 3)  # 2 machines: one branch on each
        assert all(set(ranks) <= set(branch) for ranks in res["groups"].values()), res
        assert res["error"] <= TOL, res


@pytest.mark.parametrize("guided", [True, False], ids=["true-cfg", "no-true-cfg"])
def test_flux_pipeline_with_cfg_parallel_is_exact(pool, guided):
    """Flux calls its transformer twice per step with true CFG: each branch computes one call, both at once; with
    true CFG off the one call per step is computed whole by every branch."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="torus", cfg=2)
    for res in pool.run(_pipeline, config, "tiny-flux", guided):
        assert res["cfg"] == 2 and res["restored"], res
        assert res["calls"] == ((4, 2) if guided else (2, 2)), res  # per branch: one block call per step
        assert res["block"][1] in (res["full"][1] // 2, res["full"][1] // 2 + 1), res
        assert res["error"] <= TOL, res


# Pipelines guided by two transformer calls of batch 1 per step, which the CFG split pairs: Wan (A14B: on each
# of its two experts in turn), Qwen-Image with a negative prompt of another length than the prompt.
PAIRED = {"tiny-wan": dict(num_frames=9, guidance_scale=5.0),
          "tiny-wan-a14b": dict(num_frames=9, guidance_scale=4.0),
          "tiny-qwen-image": dict(true_cfg_scale=4.0, negative_prompt="blurry")}


def _paired_latents(config: ParallelConfig, name: str) -> dict:
    """On every rank: the final latents of a guided tiny pipeline unparallelized and with cfg 2 x SP 2, the
    calls each transformer made per generation, and the tokens one of its attention layers held."""
    pipe = build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    experts = [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]
    calls = [0] * len(experts)
    seen: list[int] = []
    for i, expert in enumerate(experts):
        expert.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    attention = pipe.transformer.transformer_blocks[0].attn if name == "tiny-qwen-image" else \
        pipe.transformer.blocks[0].attn1
    attention.register_forward_pre_hook(
        lambda _m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).shape[1]), with_kwargs=True)

    def run() -> torch.Tensor:
        return pipe(prompt="a red cat under a blue sky", height=64, width=64, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="latent", **PAIRED[name])[0]

    reference, full, attended = run(), seen[-1], len(seen)
    before = list(calls)
    ctx = init_parallel(config)
    parallelize(pipe, ctx, vae=False)
    out = run()
    unparallelize(pipe)
    return {"error": relative_error(out, reference), "cfg": ctx.cfg.degree,
            "calls": (before, [c - b for c, b in zip(calls, before)]), "full": full, "held": seen[-1],
            "attended": (attended, len(seen) - attended),
            "restored": type(pipe.scheduler).step is pipe.scheduler.step.__func__}


@pytest.mark.parametrize("name", sorted(PAIRED))
def test_paired_guidance_calls_with_cfg_parallel_are_exact(pool, name):
    """cfg 2 x SP 2 on 4 ranks: each branch computes one of the step's two calls, its tokens split in two; the
    final latents are the unparallelized pipeline's."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", cfg=2)
    for res in pool.run(_paired_latents, config, name):
        assert res["cfg"] == 2 and res["restored"], res
        want = [2, 2] if name == "tiny-wan-a14b" else [4]  # A14B: one step on each expert, 2 calls each
        assert res["calls"] == (want, want), res  # every call reaches the transformer, paired in the hook
        assert res["attended"] == (want[0], want[0] // 2), res  # each branch attends for one call of the two
        assert res["held"] < res["full"], res  # the tokens really split inside the branch
        assert res["error"] <= TOL, res


def _transformer(config: ParallelConfig, case: Case) -> dict:
    """On every rank: a batch-2 transformer forward with cfg parallelism against the unparallelized one."""
    model = build_transformer(case.config, seed=3)
    inputs = case.inputs(4)
    with torch.no_grad():
        reference = model(**inputs).sample
        ctx = init_parallel(config)
        parallelize(model, ctx)
        out = model(**inputs, return_dict=False)[0]
        unparallelize(model)
    return {"error": relative_error(out, reference), "cfg": ctx.cfg.degree}


@pytest.mark.parametrize("case", [FLUX_CASES["text-joint-batch2"], COGVIDEOX_CASES["rope-text-joint"]],
                         ids=["flux", "cogvideox"])
def test_transformer_batch2_with_cfg_parallel_is_exact(pool, case):
    case = Case(case.family, case.grid, case.text, batch=2, overrides=case.overrides)
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="torus", cfg=2)
    for res in pool.run(_transformer, config, case):
        assert res["cfg"] == 2 and res["error"] <= TOL, res


def _after_a_stale_call(config: ParallelConfig) -> list[float]:
    """On every rank: Flux's paired guidance calls after a deferred call whose pair never came (the pipeline
    raised in between); the relative errors of the step's uncond and cond outputs."""
    case = FLUX_CASES["text-sharded-uneven-image"]
    model = build_transformer(case.config, seed=3)
    stale, uncond, cond = case.inputs(5), case.inputs(6), case.inputs(7)
    uncond["timestep"] = cond["timestep"]  # the two guidance calls of one step
    with torch.no_grad():
        want = [model(**x).sample for x in (uncond, cond)]
        parallelize(model, init_parallel(config))
        HookRegistry.check_if_exists_or_initialize(model).get_hook(CFG_HOOK).pair_calls(
            FlowMatchEulerDiscreteScheduler())
        model(**stale)  # deferred; no pair follows
        got = [model(**x).sample for x in (uncond, cond)]
        unparallelize(model)
    return [relative_error(g, w) for g, w in zip(got, want)]


def test_a_deferred_call_left_by_an_error_is_not_paired(pool):
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="usp", cfg=2)
    for errors in pool.run(_after_a_stale_call, config):
        assert all(e <= TOL for e in errors), errors


# LTX2Pipeline's guided call: batch [uncond ; cond] in every input that has a batch dim, the prompts' masks apart
# (the last row's text padded), a timestep per video token, the audio whole on every rank of a branch
LTX2_GUIDED = PlanCase("ltx2", (2, 3, 3), text=7, batch=2, padded_text=3, audio=11, token_timesteps=True)


def _ltx2_transformer(config: ParallelConfig) -> dict:
    """On every rank: LTX-2's batch-2 forward, its coordinates batched as the pipeline passes them, with cfg 2 x SP 2
    against the unparallelized one (video and audio outputs); the video and audio rows its first block held."""
    model, inputs = LTX2_GUIDED.model(3), LTX2_GUIDED.inputs(4)
    frames, rows, cols = LTX2_GUIDED.grid
    inputs["video_coords"] = model.rope.prepare_video_coords(2, frames, rows, cols, "cpu")
    inputs["audio_coords"] = model.audio_rope.prepare_audio_coords(2, inputs["audio_num_frames"], "cpu")
    seen: list[tuple[tuple[int, int], tuple[int, int]]] = []
    model.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((tuple(kw["hidden_states"].shape[:2]),
                                        tuple(kw["audio_hidden_states"].shape[:2]))), with_kwargs=True)
    with torch.no_grad():
        reference = model(**inputs, return_dict=False)
        ctx = init_parallel(config)
        parallelize(model, ctx)
        out = model(**inputs)  # AudioVisualModelOutput: both fields gathered
        unparallelize(model)
    return {"errors": [relative_error(out.sample, reference[0]), relative_error(out.audio_sample, reference[1])],
            "cfg": ctx.cfg.degree, "full": seen[0], "held": seen[-1]}


def test_ltx2_transformer_with_cfg_parallel_is_exact(pool):
    """Each branch runs one row of every batched input (audio, text, masks, timesteps, coordinates), its video
    split in two, the audio whole; both outputs are gathered back."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="usp", cfg=2)
    for res in pool.run(_ltx2_transformer, config):
        (batch, video), audio = res["full"]
        assert res["cfg"] == 2 and (batch, audio) == (2, (2, 11)), res
        assert res["held"][0][0] == 1 and res["held"][0][1] in (video // 2, video // 2 + 1), res
        assert res["held"][1] == (1, 11), res  # one guidance row of the whole audio
        assert all(e <= TOL for e in res["errors"]), res


def _ltx2_pipeline(config: ParallelConfig) -> dict:
    """On every rank: the guided tiny LTX-2 pipeline's final video and audio latents unparallelized and with cfg 2 x
    SP 2, and the batch its first block held."""
    pipe = build_pipeline("tiny-ltx2")
    pipe.set_progress_bar_config(disable=True)
    spec = MODELS["tiny-ltx2"]
    kwargs = family_of("tiny-ltx2").call_kwargs(spec, spec.frames, None, None, spec.max_sequence_length)
    seen: list[int] = []
    pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["audio_hidden_states"].shape[0]), with_kwargs=True)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        out = pipe(prompt="a red cat under a blue sky", height=64, width=64, num_inference_steps=2,
                   generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs)
        return out.frames, out.audio

    reference, full = run(), seen[-1]
    ctx = init_parallel(config)
    parallelize(pipe, ctx, vae=False)
    out = run()
    unparallelize(pipe)
    return {"errors": [relative_error(o, r) for o, r in zip(out, reference)], "cfg": ctx.cfg.degree,
            "guidance": kwargs["guidance_scale"], "batches": (full, seen[-1])}


def test_ltx2_pipeline_with_cfg_parallel_is_exact(pool):
    """LTX2Pipeline's one call of batch [uncond ; cond] per step: the video and audio latents are the
    unparallelized pipeline's (the guidance reads both outputs of both branches)."""
    config = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", cfg=2)
    for res in pool.run(_ltx2_pipeline, config):
        assert res["cfg"] == 2 and res["guidance"] > 1 and res["batches"] == (2, 1), res
        assert all(e <= TOL for e in res["errors"]), res


def test_auto_keeps_one_branch_for_an_unguided_batch(pool):
    config = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", cfg="auto")
    for res in pool.run(_transformer, config, COGVIDEOX_CASES["rope-text-joint"]):
        assert res["cfg"] == 1 and res["error"] <= TOL, res


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_cfg_parallel_records_two_branches(pool, tmp_path):
    job = generate.make_job(_args("--model", "tiny-cogvideox", "--cfg-parallel", "--steps", "2",
                                  "--output", str(tmp_path)))
    assert job.parallel.cfg == 2
    run = generate.write_outputs(job, pool.run(worker.generate, job)[0])
    # method auto (generate's default) chose each branch's layout on one of the 2 machines
    assert run["cfg"] == 2 and " 1x2" in run["layout"] and run["attention"][0]["why"], run
    assert json.loads((tmp_path / "run.json").read_text())["cfg"] == 2
    phases = run["phases_s"]
    assert all(phases[p] > 0 for p in ("text_encoding", "denoising", "decode")), phases
    assert phases["total"] >= phases["text_encoding"] + phases["denoising"] + phases["decode"], phases


def test_generate_cfg_parallel_needs_guidance():
    with pytest.raises(ValueError, match="--true-cfg-scale > 1"):
        generate.make_job(_args("--cfg-parallel"))  # tiny Flux, no true CFG
    assert generate.make_job(_args("--cfg-parallel", "auto")).parallel.cfg == 1
    assert generate.make_job(_args("--cfg-parallel", "--true-cfg-scale", "3")).parallel.cfg == 2

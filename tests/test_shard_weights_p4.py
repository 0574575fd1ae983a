"""Weights sharded by FSDP2 under sequence parallelism, on 4 gloo processes: `parallelize(..., shard_weights=True)`
gives the unsharded parallel run's output (float32, relative error <= 1e-5) for every model family (whole tiny
pipelines, text encoders sharded too, uneven token counts) under ulysses 1 x 4, and for one model under torus 2 x 2
and ring; it composes with the CFG split, LoRA (adapters added before and after), compiled blocks and diffusers'
FirstBlockCache; between forwards each rank holds a quarter of the parameter bytes; what it cannot compose with is
refused in one line; `generate --shard-weights` runs and says so in run.json."""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from model_cases import FLUX_CASES

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.sharded_weights import (CANNOT_UNDO, NOT_QUANTIZED, NOT_WITH_GRAPHS,
                                                                full_weights, local_bytes)
from streamfusion_diffusers.diffusers.stack.quantize import quantize
from streamfusion_diffusers.models.build import build_pipeline, build_transformer

WORLD = 4
TOL = 1e-5
ULYSSES = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses")
TORUS = ParallelConfig(machines=2, gpus_per_machine=2, method="torus")
RING = ParallelConfig(machines=1, gpus_per_machine=4, method="ring")
# sizes whose token counts do not divide by 4 (uneven slices), and the guidance each pipeline takes
PIPELINES = {"tiny-flux": dict(height=36, width=36),  # 9 x 9 tokens
             "tiny-flux2": dict(height=40, width=24),  # 5 x 3
             "tiny-qwen-image": dict(height=80, width=48),  # 5 x 3
             "tiny-wan-a14b": dict(height=48, width=80, num_frames=9),  # 3 latent frames x 3 x 5, both experts
             "tiny-cogvideox": dict(height=48, width=80, num_frames=9)}  # 3 x 3 x 5


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _share(models: list[torch.nn.Module]) -> float:
    held, whole = (sum(x) for x in zip(*(local_bytes(m) for m in models)))
    return held / whole


def _pipeline(name: str, config: ParallelConfig, cfg_kwargs: dict | None = None) -> dict:
    """On every rank: the final latents of a tiny pipeline parallelized, then of the same pipeline (rebuilt: a
    sharded one cannot be unparallelized) parallelized with its weights sharded; the share of the parameter
    bytes each rank held after the run."""
    kwargs = {**PIPELINES[name], **(cfg_kwargs or {})}

    def run(shard: bool) -> tuple[torch.Tensor, object]:
        pipe = build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        parallelize(pipe, init_parallel(config), vae=False, shard_weights=shard)
        with torch.no_grad():
            out = pipe(prompt="a red cat under a blue sky", num_inference_steps=2, output_type="latent",
                       generator=torch.Generator().manual_seed(0), **kwargs)[0]
        return out, pipe

    reference, _ = run(False)
    out, pipe = run(True)
    parts = [pipe.components[n] for n in pipe.transformer._streamfusion.sharded]
    return {"error": relative_error(out, reference), "sharded": pipe.transformer._streamfusion.sharded,
            "share": _share(parts), "dtensor": type(pipe.transformer.proj_out.weight).__name__}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_model_sharded_gives_the_parallel_output(pool, name):
    for res in pool.run(_pipeline, name, ULYSSES):
        assert res["error"] <= TOL, res
        assert res["sharded"][0] == "transformer" and any(n.startswith("text_encoder") for n in res["sharded"]), res
        assert ("transformer_2" in res["sharded"]) == (name == "tiny-wan-a14b"), res
        assert res["dtensor"] == "DTensor" and res["share"] <= 0.26, res  # a quarter, give or take the padding


def _transformer(config: ParallelConfig, how: str) -> dict:
    """On every rank: tiny Flux at an uneven token count, parallelized, against the same model parallelized with
    its weights sharded, two forwards; `how` adds LoRA before or after the sharding, compiles the blocks, runs under
    inference_mode, or makes a forward raise first."""
    case = FLUX_CASES["text-sharded-uneven-image"]
    inputs = case.inputs(4)

    def model(shard: bool) -> torch.nn.Module:
        m = build_transformer(case.config, seed=3)
        if how == "lora-before":
            _lora(m)
        if how == "compiled":  # before the sharding: diffusers finds the blocks by class name, which FSDP2 changes
            m.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        parallelize(m, init_parallel(config), shard_weights=shard)
        if how == "lora-after":
            with full_weights(m) if shard else nullcontext():
                _lora(m)
        return m

    with torch.inference_mode() if how == "inference-mode" else torch.no_grad():
        reference = model(False)(**inputs).sample
        sharded = model(True)
        between = _share([sharded])
        if how == "after-an-error":  # every rank raises inside the second block, once
            handle = sharded.single_transformer_blocks[0].register_forward_pre_hook(_fail)
            try:
                sharded(**inputs)
            except RuntimeError:
                handle.remove()
            between = _share([sharded])  # nothing left gathered by the forward that raised
        outs = [sharded(**inputs).sample for _ in range(2)]
    return {"errors": [relative_error(o, reference) for o in outs], "share": between, "after": _share([sharded])}


def _fail(*_: object) -> None:
    raise RuntimeError("a block failed")


def _lora(model: torch.nn.Module) -> None:
    """A peft LoRA adapter on the attention projections, seeded, nonzero (so that it changes the output)."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(7)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False),
                            model)


@pytest.mark.parametrize(("config", "how"), [(TORUS, "plain"), (ULYSSES, "plain"), (RING, "plain"),
                                             (ULYSSES, "lora-before"), (TORUS, "lora-after"),
                                             (ULYSSES, "compiled"), (TORUS, "inference-mode"),
                                             (ULYSSES, "after-an-error")],
                         ids=["torus", "ulysses", "ring", "lora-before", "lora-after", "compiled", "inference-mode",
                              "after-an-error"])
def test_a_sharded_transformer_gives_the_parallel_output(pool, config, how):
    for res in pool.run(_transformer, config, how):
        assert all(e <= TOL for e in res["errors"]), res
        if how != "lora-after":  # adapters added after stay whole on every rank (a few kB)
            assert res["share"] <= 0.26 and res["after"] == res["share"], res  # resharded after every forward


def test_the_cfg_split_with_sharded_weights(pool):
    """cfg 2 x ulysses 2: the weights shard over all four ranks (both branches run every forward together)."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", cfg=2)
    for res in pool.run(_pipeline, "tiny-wan-a14b", config, dict(guidance_scale=4.0)):
        assert res["error"] <= TOL and res["share"] <= 0.26, res


def _two_worlds() -> dict:
    """On every rank: two SP groups of 2 in one job (worlds [[0, 1], [2, 3]], as xDiT's data-parallel copies), each
    running its own inputs with sharded weights: each world shards over its own two ranks only."""
    case = FLUX_CASES["text-sharded-uneven-image"]
    world = dist.get_rank() // 2
    inputs = case.inputs(4 + world)
    with torch.no_grad():
        reference = build_transformer(case.config, seed=3)(**inputs).sample
        model = build_transformer(case.config, seed=3)
        parallelize(model, init_parallel(ParallelConfig(machines=1, gpus_per_machine=2, method="ulysses"),
                                         worlds=[[0, 1], [2, 3]]), shard_weights=True)
        out = model(**inputs).sample
    return {"error": relative_error(out, reference), "share": _share([model])}


def test_each_world_shards_over_its_own_ranks(pool):
    for res in pool.run(_two_worlds):
        assert res["error"] <= 1e-4 and 0.49 <= res["share"] <= 0.51, res


def _cached(config: ParallelConfig) -> dict:
    """On every rank: tiny Flux with diffusers' FirstBlockCache (a threshold that skips the later blocks from the
    second step on), parallelized, unsharded against sharded; which runs computed the last block's attention."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    calls = []

    def run(shard: bool) -> torch.Tensor:
        pipe = build_pipeline("tiny-flux")
        pipe.set_progress_bar_config(disable=True)
        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=1e6))
        pipe.transformer.single_transformer_blocks[0].attn.register_forward_pre_hook(lambda *_: calls.append(shard))
        parallelize(pipe, init_parallel(config), vae=False, shard_weights=shard)
        with torch.no_grad():
            return pipe(prompt="a red cat", num_inference_steps=3, output_type="latent", height=36, width=36,
                        generator=torch.Generator().manual_seed(0))[0]

    return {"error": relative_error(run(True), run(False)), "calls": calls}


def test_first_block_cache_with_sharded_weights(pool):
    for res in pool.run(_cached, ULYSSES):
        assert res["error"] <= TOL, res
        assert res["calls"] == [True, False], res  # the later blocks ran at the first step only, then were skipped


def _refusals() -> list[str]:
    model = build_transformer(FLUX_CASES["text-sharded-uneven-image"].config, seed=3)
    ctx = init_parallel(ULYSSES)
    said = []
    try:
        parallelize(model, ctx, shard_weights=True, cuda_graph=True)
    except ValueError as e:
        said.append(str(e))
    quantized = build_transformer(FLUX_CASES["text-sharded-uneven-image"].config, seed=3)
    quantize([quantized], "int8")  # generate --quantize int8
    try:
        parallelize(quantized, ctx, shard_weights=True)
    except ValueError as e:
        said.append(str(e))
    parallelize(model, ctx, shard_weights=True)
    try:
        unparallelize(model)
    except ValueError as e:
        said.append(str(e))
    said.append(str(model._streamfusion is not None))  # the refusal changed nothing
    return said


def test_what_sharding_cannot_compose_with_is_refused_in_one_line(pool):
    for said in pool.run(_refusals):
        assert said == [NOT_WITH_GRAPHS, NOT_QUANTIZED, CANNOT_UNDO, "True"], said


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_with_sharded_weights_says_so(pool, tmp_path):
    job = generate.make_job(_args("--model", "tiny-wan", "--steps", "2", "--height", "64", "--width", "96",
                                  "--shard-weights", "--output", str(tmp_path)))
    assert job.shard_weights
    generate.write_outputs(job, pool.run(worker.generate, job)[0])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["shard_weights"] and run["sharded"] == ["transformer", "text_encoder"], run


@pytest.mark.parametrize(("option", "message"), [(("--cuda-graph",), "with --cuda-graph"),
                                               (("--quantize", "int8"), "with --quantize")])
def test_generate_refuses_what_sharded_weights_cannot_compose_with(option, message):
    with pytest.raises(ValueError, match=f"--shard-weights does not compose {message}"):
        generate.make_job(_args("--model", "tiny-wan", "--shard-weights", *option, "--cpu"))

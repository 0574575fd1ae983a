"""Weights sharded and gathered in place under sequence parallelism, on 4 gloo processes: `parallelize(...,
shard_weights=True)` gives the unsharded parallel run's output (float32, relative error <= 1e-5) for every model
family (whole tiny pipelines, text encoders sharded too, uneven token counts) under ulysses 1 x 4, and for one model
under torus 2 x 2 and ring; with a memory budget only some blocks stream (the rest kept gathered), as the memory
planner says; quantized int8 weights shard as their bytes and scales; Wan 2.2's experts share one resident region
(the one that runs is gathered there); every forward gathers into the same addresses (what a CUDA graph replays);
it composes with the CFG split, LoRA (adapters added before and after), compiled blocks, inference_mode and
diffusers' FirstBlockCache; each rank holds the bytes the plan says; `generate --shard-weights` runs and says so in
run.json."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.distributed as dist
from model_cases import FLUX_CASES, Case

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.targets import transformers_of
from streamfusion_diffusers.diffusers.sharded_weights import CANNOT_UNDO, held_bytes, is_sharded, shardable_parts
from streamfusion_diffusers.diffusers.stack.quantize import quantize
from streamfusion_diffusers.diffusers.weight_split import choose_split, part_sizes
from streamfusion_diffusers.models.build import build_pipeline, build_transformer
from streamfusion_diffusers.models.configs import MODELS
from streamfusion_diffusers.models.memory import GIB, estimate, pipeline_parts

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


def _to_q(transformer: torch.nn.Module) -> tuple[str, tuple[int, ...]] | None:
    """The first joint block's query projection weight, its type and shape (None for a model without Flux's
    blocks)."""
    blocks = getattr(transformer, "transformer_blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks else None
    return None if attn is None else (type(attn.to_q.weight).__name__, tuple(attn.to_q.weight.shape))


def _held(models: list[torch.nn.Module]) -> int:
    return held_bytes(models)[0]


def _pipeline(name: str, config: ParallelConfig, cfg_kwargs: dict | None = None, budget: float | None = None,
              quantized: bool = False, streamed: str = "gather") -> dict:
    """On every rank: the final latents of a tiny pipeline parallelized, then of the same pipeline (rebuilt: a
    sharded one cannot be unparallelized) parallelized with its weights sharded (within `budget`, a share of the
    way from everything sharded to everything whole); the bytes each rank held after the run against the plan's,
    and which of its transformers' resident weights the gathers wrote (Wan 2.2's experts)."""
    kwargs = {**PIPELINES[name], **(cfg_kwargs or {})}

    def run(shard: bool, summed: list[int] | None = None) -> tuple[torch.Tensor, object]:
        pipe = build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        if quantized:
            quantize([pipe.transformer], "int8")
        weight_budget = None
        if shard and budget is not None:
            parts = {n: part_sizes(m) for n, m in shardable_parts(pipe, transformers_of(pipe)).items()}
            low, high = choose_split(parts, WORLD, None, ("transformer",)).held, sum(p.total for p in parts.values())
            weight_budget = int(low + budget * (high - low))
        parallelize(pipe, init_parallel(config), vae=False, shard_weights=shard, weight_budget=weight_budget,
                    streamed=streamed)
        for module in pipe.transformer.modules():
            if summed is not None and hasattr(module, "summed_bias"):  # a row-parallel projection
                module.register_forward_hook(lambda m, i, o: summed.append(o.numel() * o.element_size()))
        with torch.no_grad():
            out = pipe(prompt="a red cat under a blue sky", num_inference_steps=2, output_type="latent",
                       generator=torch.Generator().manual_seed(0), **kwargs)[0]
        return out, pipe

    reference, _ = run(False)
    summed: list[int] = []  # the bytes each all-reduce of a tensor-parallel block carried
    out, pipe = run(True, summed)
    installed = pipe.transformer._streamfusion
    parts = list(shardable_parts(pipe, transformers_of(pipe)).values())
    experts = [t._shards for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]
    planned = estimate(name, kwargs["height"], kwargs["width"], kwargs.get("num_frames", 1), WORLD, cfg=config.cfg,
                       sharded=True,
                       parts=pipeline_parts(name, dtype=out.dtype), streamed=streamed,
                       bytes_per_value=out.element_size())  # `plan --memory`'s, from a
    # meta build
    return {"error": relative_error(out, reference), "sharded": installed.sharded, "keep": installed.split.keep,
            "held": _held(parts), "planned": installed.split.held, "whole": held_bytes(parts)[1],
            "plan_memory": (planned.weights + planned.gathered) * GIB, "vae": _held([pipe.vae]),
            "owner": [m.region.owner is m for m in experts if m.region is not None],
            "quantized": type(pipe.transformer.proj_out.weight).__name__, "tensor": installed.split.tensor,
            "to_q": _to_q(pipe.transformer),
            "summed_per_step": sum(summed) * 2 * (WORLD - 1) / WORLD / 2, "planned_tokens": planned.tokens * GIB}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_model_sharded_gives_the_parallel_output(pool, name):
    for res in pool.run(_pipeline, name, ULYSSES):
        assert res["error"] <= TOL, res
        assert res["sharded"][0] == "transformer" and any(n.startswith("text_encoder") for n in res["sharded"]), res
        assert ("transformer_2" in res["sharded"]) == (name == "tiny-wan-a14b"), res
        assert set(res["keep"].values()) == {0}, res  # no budget: every block streams
        assert res["held"] == res["planned"], res  # the plan's bytes, to the byte (tiny models: above whole, the
        # two slots are as large as their few blocks)
        assert res["plan_memory"] == pytest.approx(res["held"] + res["vae"], rel=0.05), res  # and plan --memory's


def _partial(share: float, streamed: str = "gather") -> dict:
    """On every rank: a tiny Flux of 2 + 6 blocks, parallelized, against the same model sharded within a budget
    `share` of the way from everything streamed to everything whole: some blocks kept, the others streamed (as
    `streamed` says)."""
    case = Case("flux", (6, 5), text=8, overrides={"num_layers": 2, "num_single_layers": 6})
    inputs = case.inputs(4)
    sizes = {"transformer": part_sizes(build_transformer(case.config, seed=3))}
    tensor = ("transformer",) if streamed == "tensor" else ()
    low, high = choose_split(sizes, WORLD, None, tensor).held, sizes["transformer"].total
    ctx = init_parallel(ULYSSES)
    with torch.no_grad():
        reference = parallelize(build_transformer(case.config, seed=3), ctx)(**inputs).sample
        model = build_transformer(case.config, seed=3)
        parallelize(model, ctx, shard_weights=True, weight_budget=int(low + share * (high - low)), streamed=streamed)
        outs = [model(**inputs).sample for _ in range(2)]
    split = model._streamfusion.split
    return {"errors": [relative_error(o, reference) for o in outs], "keep": split.keep["transformer"],
            "streamed": len(model._shards.streamed) + len(model._shards.tensor), "held": _held([model]),
            "planned": split.held, "whole": high, "tensor": split.tensor}


def test_a_partial_split_keeps_some_blocks_gathered(pool):
    for res in pool.run(_partial, 0.5):
        assert all(e <= TOL for e in res["errors"]), res
        assert 0 < res["keep"] < 8 and res["streamed"] == 8 - res["keep"], res
        assert res["held"] == res["planned"] < res["whole"], res


def test_quantized_weights_shard_as_their_bytes(pool):
    """int8 weight-only (torchao) in both runs: the sharded one gathers the int8 data and scales, exactly."""
    for res in pool.run(_pipeline, "tiny-flux", ULYSSES, quantized=True):
        assert res["error"] <= TOL and res["quantized"] == "Int8Tensor", res
        assert res["held"] == res["planned"], res


def test_wan_experts_share_one_resident_region(pool):
    """Wan 2.2 A14B: both experts keep most of their blocks gathered, in one region: the one that ran last holds
    it, the other is sharded; the held bytes count the region once."""
    for res in pool.run(_pipeline, "tiny-wan-a14b", ULYSSES, budget=0.6):
        assert res["error"] <= TOL, res
        assert res["keep"]["transformer"] == res["keep"]["transformer_2"] > 0, res
        assert res["owner"] == [False, True], res  # the low-noise expert ran last
        assert res["held"] == res["planned"], res


def _transformer(config: ParallelConfig, how: str, streamed: str = "gather", case: Case | None = None) -> dict:
    """On every rank: tiny Flux at an uneven token count (or `case`), parallelized, against the same model
    parallelized with its weights sharded, its streamed blocks run as `streamed` says, two forwards; `how` adds
    LoRA before or after the sharding, compiles the blocks, runs under inference_mode, or makes a forward raise
    first."""
    case = case or FLUX_CASES["text-sharded-uneven-image"]
    inputs = case.inputs(4)

    def model(shard: bool) -> torch.nn.Module:
        m = build_transformer(case.config, seed=3)
        if how == "lora-before":
            _lora(m)
        if how == "compiled":
            m.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        parallelize(m, init_parallel(config), shard_weights=shard, streamed=streamed)
        if how == "lora-after":  # the sharded parameters keep their whole shapes: peft sizes its adapters from them
            _lora(m)
        return m

    with torch.inference_mode() if how == "inference-mode" else torch.no_grad():
        reference = model(False)(**inputs).sample
        sharded = model(True)
        if how == "after-an-error":  # every rank raises inside the second block, once
            handle = sharded.single_transformer_blocks[0].register_forward_pre_hook(_fail)
            try:
                sharded(**inputs)
            except RuntimeError:
                handle.remove()
        outs = [sharded(**inputs).sample for _ in range(2)]
    return {"errors": [relative_error(o, reference) for o in outs], "held": _held([sharded]),
            "planned": sharded._streamfusion.split.held, "tensor": sharded._streamfusion.split.tensor}


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
            assert res["held"] == res["planned"], res


def _in_place() -> dict:
    """On every rank: tiny Flux sharded (every block streamed), three forwards; each gather's (destination,
    source, bytes) and every parameter's address, forward by forward: what a CUDA graph captures and replays."""
    case = FLUX_CASES["text-sharded-uneven-image"]
    inputs = case.inputs(4)
    model = build_transformer(case.config, seed=3)
    parallelize(model, init_parallel(ULYSSES), shard_weights=True)
    pool = model._shards.pool
    writes: list[tuple[int, int, int]] = []
    gather = pool.gather

    def recorded(unit, out, async_op=False):
        writes.append((out.data_ptr(), unit.shard.data_ptr(), unit.size))
        return gather(unit, out, async_op)

    pool.gather = recorded
    forwards, addresses, outs = [], [], []
    with torch.no_grad():
        for _ in range(3):
            writes.clear()
            outs.append(model(**inputs).sample)
            forwards.append(list(writes))
            addresses.append([p.data_ptr() for p in model.parameters()])
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    return {"forwards": forwards, "addresses": addresses, "blocks": blocks,
            "same": [relative_error(o, outs[0]) for o in outs]}


def test_every_forward_gathers_into_the_same_addresses(pool):
    for res in pool.run(_in_place):
        assert len(res["forwards"][0]) == res["blocks"], res  # each streamed block once, the resident never again
        assert res["forwards"][1] == res["forwards"][0] == res["forwards"][2], res
        assert res["addresses"][1] == res["addresses"][0] == res["addresses"][2], res
        assert max(res["same"]) == 0.0, res


def test_the_cfg_split_with_sharded_weights(pool):
    """cfg 2 x ulysses 2: the weights shard over all four ranks (both branches run every forward together)."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", cfg=2)
    for res in pool.run(_pipeline, "tiny-wan-a14b", config, dict(guidance_scale=4.0)):
        assert res["error"] <= TOL and res["held"] == res["planned"], res


def _two_worlds(streamed: str = "gather") -> dict:
    """On every rank: two SP groups of 2 in one job (worlds [[0, 1], [2, 3]], as xDiT's data-parallel copies), each
    running its own inputs with sharded weights: each world shards over its own two ranks only (its blocks
    tensor-parallel over them with streamed="tensor")."""
    case = FLUX_CASES["text-sharded-uneven-image"]
    world = dist.get_rank() // 2
    inputs = case.inputs(4 + world)
    with torch.no_grad():
        reference = build_transformer(case.config, seed=3)(**inputs).sample
        model = build_transformer(case.config, seed=3)
        parallelize(model, init_parallel(ParallelConfig(machines=1, gpus_per_machine=2, method="ulysses"),
                                         worlds=[[0, 1], [2, 3]]), shard_weights=True, streamed=streamed)
        out = model(**inputs).sample
    return {"error": relative_error(out, reference), "held": _held([model]),
            "planned": model._streamfusion.split.held, "size": model._shards.pool.group.size(),
            "tensor": model._streamfusion.split.tensor}


@pytest.mark.parametrize("streamed", ["gather", "tensor"])
def test_each_world_shards_over_its_own_ranks(pool, streamed):
    for res in pool.run(_two_worlds, streamed):
        assert res["error"] <= 1e-4 and res["held"] == res["planned"] and res["size"] == 2, res
        assert res["tensor"] == (("transformer",) if streamed == "tensor" else ()), res


def _cached(config: ParallelConfig, streamed: str = "gather") -> dict:
    """On every rank: tiny Flux with diffusers' FirstBlockCache (a threshold that skips the later blocks from the
    second step on), parallelized, unsharded against sharded; which runs computed the last block's attention."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    calls, tensor = [], []

    def run(shard: bool) -> torch.Tensor:
        pipe = build_pipeline("tiny-flux")
        pipe.set_progress_bar_config(disable=True)
        apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=1e6))
        pipe.transformer.single_transformer_blocks[0].attn.register_forward_pre_hook(lambda *_: calls.append(shard))
        parallelize(pipe, init_parallel(config), vae=False, shard_weights=shard, streamed=streamed)
        if shard:
            tensor.append(pipe.transformer._streamfusion.split.tensor)
        with torch.no_grad():
            return pipe(prompt="a red cat", num_inference_steps=3, output_type="latent", height=36, width=36,
                        generator=torch.Generator().manual_seed(0))[0]

    return {"error": relative_error(run(True), run(False)), "calls": calls, "tensor": tensor}


@pytest.mark.parametrize("streamed", ["gather", "tensor"])
def test_first_block_cache_with_sharded_weights(pool, streamed):
    """Tensor-parallel blocks too: the cache's hooks see this rank's rows, outside the block's gathers."""
    for res in pool.run(_cached, ULYSSES, streamed):
        assert res["error"] <= TOL and res["tensor"] == [("transformer",) if streamed == "tensor" else ()], res
        assert res["calls"] == [True, False], res  # the later blocks ran at the first step only, then were skipped


def _refusals() -> list[str]:
    model = build_transformer(FLUX_CASES["text-sharded-uneven-image"].config, seed=3)
    ctx = init_parallel(ULYSSES)
    said = []
    parallelize(model, ctx, shard_weights=True)
    try:
        unparallelize(model)
    except ValueError as e:
        said.append(str(e))
    said.append(str(model._streamfusion is not None and is_sharded(model)))  # the refusal changed nothing
    return said


def test_unparallelize_refuses_sharded_weights_in_one_line(pool):
    for said in pool.run(_refusals):
        assert said == [CANNOT_UNDO, "True"], said


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


def test_generate_with_tensor_parallel_blocks_says_so(pool, tmp_path):
    job = generate.make_job(_args("--model", "tiny-flux2", "--steps", "2", "--shard-weights", "--streamed-blocks",
                                  "tensor", "--output", str(tmp_path)))
    generate.write_outputs(job, pool.run(worker.generate, job)[0])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["weight_split"]["tensor_parallel"] == ["transformer"], run
    assert run["streamed_blocks"] == "tensor", run
    with pytest.raises(ValueError, match="add --shard-weights or drop it"):
        generate.make_job(_args("--model", "tiny-flux2", "--streamed-blocks", "tensor"))


@pytest.mark.parametrize(("model", "size", "chosen"), [("tiny-flux2", ("--height", "64", "--width", "64"),
                                                      ["transformer"]),
                                                     ("tiny-wan", ("--height", "64", "--width", "96"), [])])
def test_generate_streamed_blocks_auto_moves_fewer_bytes(pool, tmp_path, model, size, chosen):
    """auto, the default: tensor-parallel where the token rows are fewer bytes than the weights (tiny Flux.2's
    image), gathered where the model has no tensor-parallel plan (Wan)."""
    job = generate.make_job(_args("--model", model, "--steps", "1", *size, "--shard-weights", "--output",
                                  str(tmp_path)))
    generate.write_outputs(job, pool.run(worker.generate, job)[0])
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["weight_split"]["tensor_parallel"] == chosen and run["streamed_blocks"] == "auto", run


def test_generate_shards_with_quantized_weights():
    job = generate.make_job(_args("--model", "tiny-wan", "--shard-weights", "--quantize", "int8", "--cpu"))
    assert job.shard_weights and job.stack.quantize == "int8"


# Streamed blocks run tensor-parallel (tensor_blocks.py): the models with a diffusers tensor-parallel plan


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-flux2", "tiny-qwen-image"])
def test_tensor_parallel_blocks_give_the_parallel_output(pool, name):
    """Every block tensor-parallel (its tokens gathered, 1/4 of its projections held), uneven token counts: the
    unsharded parallel output, the plan's bytes to the byte, and plan --memory's within 5%."""
    text = {"max_sequence_length": MODELS[name].max_sequence_length} if name != "tiny-qwen-image" else {}  # as
    # generate passes it (Qwen-Image's prompt is as long as its tokens: the plan counts no text rows for it)
    for res in pool.run(_pipeline, name, ULYSSES, text, streamed="tensor"):
        assert res["error"] <= TOL and res["tensor"] == ("transformer",), res
        assert res["held"] == res["planned"], res
        assert res["plan_memory"] == pytest.approx(res["held"] + res["vae"], rel=0.05), res
        if text:
            assert res["summed_per_step"] == pytest.approx(res["planned_tokens"], rel=1e-6), res  # plan --memory's


def test_tensor_parallel_blocks_beside_kept_ones(pool):
    """A budget keeps some of tiny Flux's blocks gathered (they attend sequence-parallel), the rest run
    tensor-parallel: the two kinds alternate in one forward."""
    for res in pool.run(_partial, 0.5, "tensor"):
        assert all(e <= TOL for e in res["errors"]) and res["tensor"] == ("transformer",), res
        assert 0 < res["keep"] < 8 and res["streamed"] == 8 - res["keep"], res
        assert res["held"] == res["planned"] < res["whole"], res


@pytest.mark.parametrize(("config", "how", "case"), [(TORUS, "plain", None), (RING, "plain", None),
                                                     (ULYSSES, "compiled", None), (TORUS, "inference-mode", None),
                                                     (ULYSSES, "after-an-error", None),
                                                     (ULYSSES, "plain", Case("flux", (8, 8), text=3, batch=2))],
                         ids=["torus", "ring", "compiled", "inference-mode", "after-an-error", "text-whole-batch2"])
def test_tensor_parallel_blocks_under_every_layout(pool, config, how, case):
    """Torus and ring split the tokens as Ulysses does; a text shorter than the ranks stays whole on every rank."""
    for res in pool.run(_transformer, config, how, "tensor", case):
        assert all(e <= TOL for e in res["errors"]) and res["tensor"] == ("transformer",), res
        assert res["held"] == res["planned"], res


def test_tensor_parallel_blocks_with_the_cfg_split(pool):
    """cfg 2 x ulysses 2, Qwen-Image's true CFG: the weights shard over all four ranks, each branch's two run the
    tensor-parallel blocks over its own tokens (they hold half of each cut projection)."""
    config = ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses", cfg=2)
    guided = dict(true_cfg_scale=4.0, negative_prompt="blurry")
    for res in pool.run(_pipeline, "tiny-qwen-image", config, guided, streamed="tensor"):
        assert res["error"] <= TOL and res["tensor"] == ("transformer",), res
        assert res["held"] == res["planned"], res
        assert res["plan_memory"] == pytest.approx(res["held"] + res["vae"], rel=0.05), res


def test_quantized_weights_run_tensor_parallel(pool):
    """int8 weight-only (torchao) in both runs: a tensor-parallel block keeps its share of the int8 data, its
    per-row scales cut with the rows (colwise) or kept whole (rowwise), exactly."""
    for res in pool.run(_pipeline, "tiny-flux", ULYSSES, quantized=True, streamed="tensor"):
        assert res["error"] <= TOL and res["quantized"] == "Int8Tensor" and res["tensor"] == ("transformer",), res
        assert res["to_q"] == ("Int8Tensor", (32, 128)), res  # a quarter of its 128 output features
        assert res["held"] == res["planned"], res


def test_blocks_tensor_parallel_cannot_run_are_gathered(pool):
    """LoRA layers inside the blocks: they stream gathered instead, with the same output."""
    for res in pool.run(_transformer, ULYSSES, "lora-before", "tensor"):
        assert all(e <= TOL for e in res["errors"]) and res["tensor"] == (), res


def _gathers_per_forward(layers: tuple[int, int]) -> dict:
    """On every rank: tiny Flux with `layers` (double, single) blocks, every block tensor-parallel; the token
    gathers one forward makes, and its error against the unsharded parallel model."""
    from streamfusion_diffusers.diffusers import token_rows

    case = Case("flux", (6, 5), text=8, overrides={"num_layers": layers[0], "num_single_layers": layers[1]})
    inputs = case.inputs(4)
    ctx = init_parallel(ULYSSES)
    calls = []
    gather = token_rows.gather

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    with torch.no_grad():
        reference = parallelize(build_transformer(case.config, seed=3), ctx)(**inputs).sample
        model = build_transformer(case.config, seed=3)
        parallelize(model, ctx, shard_weights=True, streamed="tensor")
        token_rows.gather = counted
        try:
            out = model(**inputs).sample
        finally:
            token_rows.gather = gather
    return {"gathers": len(calls), "error": relative_error(out, reference)}


def test_rows_a_tensor_parallel_block_cut_are_not_gathered_again(pool):
    """Consecutive tensor-parallel blocks pass their whole rows on: a forward gathers its first block's inputs and
    its rotary tables only, however many blocks follow."""
    few, many = pool.run(_gathers_per_forward, (1, 1))[0], pool.run(_gathers_per_forward, (2, 6))[0]
    assert few["error"] <= TOL and many["error"] <= TOL, (few, many)
    assert few["gathers"] == many["gathers"] == 6, (few, many)  # image, text; each rotary table's text and image


def _per_token_modulation() -> dict:
    """On every rank: a tiny Qwen-Image with Edit-2511's per-token modulation (zero_cond_t: an input image's tokens
    modulated apart, by an index per image token) and one input image, parallelized, against the same model with
    every block tensor-parallel (the index gathered whole with the image's rows)."""
    from plan_cases import CONFIGS

    from streamfusion_diffusers.models.inputs import build, inputs

    config = {**CONFIGS["qwen-image"], "zero_cond_t": True}
    given = inputs("qwen-image", config, (3, 5), 6, references=((2, 3),), seed=1)
    ctx = init_parallel(ULYSSES)
    with torch.no_grad():
        reference = parallelize(build("qwen-image", config, seed=3), ctx)(**given).sample
        model = build("qwen-image", config, seed=3)
        parallelize(model, ctx, shard_weights=True, streamed="tensor")
        out = model(**given).sample
    return {"error": relative_error(out, reference), "tensor": model._streamfusion.split.tensor}


def test_per_token_modulation_runs_tensor_parallel(pool):
    for res in pool.run(_per_token_modulation):
        assert res["error"] <= TOL and res["tensor"] == ("transformer",), res

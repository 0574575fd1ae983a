"""The "streamfusion" attention backend (diffusers/processors/backend.py): registered in diffusers' registry the
way its dispatcher, `set_attention_backend` and `attention_backend` look backends up, checked against what
diffusers must still provide (these tests fail loudly when a diffusers release changes it); and Flux's one
attention path: `FluxSPAttnProcessor` (for `set_attn_processor` users who shard the tokens themselves) is
diffusers' own FluxAttnProcessor on that backend, exact over 4 gloo ranks."""
from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_dispatch import (AttentionBackendName, _AttentionBackendRegistry, attention_backend,
                                                 dispatch_attention_fn)
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from model_cases import FLUX_CASES, TOL, Case, context

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.core.sequence import gather, shard
from streamfusion_diffusers.diffusers.processors import FluxSPAttnProcessor, backend
from streamfusion_diffusers.models.build import build_transformer

STOCK = {m.value for m in AttentionBackendName if m.value != backend.BACKEND}


def test_registered_where_diffusers_looks_backends_up():
    member = backend.backend_name()
    assert member is backend.backend_name()  # registered once
    assert AttentionBackendName(backend.BACKEND) is member and member.value == backend.BACKEND
    assert AttentionBackendName[backend.BACKEND.upper()] is member
    assert _AttentionBackendRegistry._backends[member] is backend.streamfusion_attention
    assert {m.value for m in AttentionBackendName} == STOCK | {backend.BACKEND}  # diffusers' own ones untouched


def test_the_dispatcher_the_module_setter_and_the_context_manager_reach_it():
    """Each way diffusers selects a backend ends in ours: the call without a route names what is missing."""
    backend.backend_name()
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="called without its route"):
        dispatch_attention_fn(x, x, x, backend=backend.backend_name())
    with attention_backend(backend.BACKEND), pytest.raises(ValueError, match="called without its route"):
        dispatch_attention_fn(x, x, x)
    model = build_transformer(FLUX_CASES["text-joint-batch2"].config)
    attn = model.transformer_blocks[0].attn
    attn.set_attention_backend(backend.BACKEND)  # diffusers' public per-module setter accepts the name
    assert attn.processor._attention_backend is backend.backend_name()


def test_a_changed_diffusers_fails_naming_the_version(monkeypatch):
    monkeypatch.delattr(_AttentionBackendRegistry, "register")
    with pytest.raises(RuntimeError, match=r"diffusers .* changed its attention backend registry .*register.*"
                                           r"install diffusers==0.42.1"):
        backend._check_diffusers()


def test_flux_adapter_is_the_stock_call_with_rope_in_one_pass_on_the_backend():
    from streamfusion_diffusers.diffusers.processors.flux import FluxRotaryAttnProcessor

    processor = FluxSPAttnProcessor.__new__(FluxSPAttnProcessor)  # no context needed to read the class
    assert isinstance(processor, FluxAttnProcessor)
    # the one call that `parallelize` routes too: diffusers' step for step, RoPE in one pass (bit for bit on GPUs:
    # tests/test_graphs.py, test_rotary_twins_give_the_stock_processors_output)
    assert FluxSPAttnProcessor.__call__ is FluxRotaryAttnProcessor.__call__


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4) as p:
        yield p


def adapter_vs_reference(config: ParallelConfig, seed: int) -> dict:
    """On every rank: a tiny Flux with FluxSPAttnProcessor set on every attention, its inputs cut into equal
    slices by hand (text and image tokens, ids), the output gathered, against the unparallelized model's."""
    case = Case("flux", (8, 8), text=8)
    model, inputs = build_transformer(case.config, seed=seed), case.inputs(seed + 1)
    ctx = context(config)
    rank, world = ctx.rank, ctx.world_size
    with torch.no_grad():
        reference = model(**inputs).sample
        model.set_attn_processor(FluxSPAttnProcessor(ctx))
        mine = {**inputs, "hidden_states": shard(inputs["hidden_states"], rank, world),
                "encoder_hidden_states": shard(inputs["encoder_hidden_states"], rank, world),
                "img_ids": shard(inputs["img_ids"], rank, world, dim=0),
                "txt_ids": shard(inputs["txt_ids"], rank, world, dim=0)}
        out = gather(model(**mine).sample, [case.image_tokens // world] * world, ctx.cfg.sp.pg)
    routed = {(type(p).__name__, p._attention_backend.value) for p in model.attn_processors.values()}
    return {"error": relative_error(out, reference), "routed": routed}


@pytest.mark.parametrize("config", [ParallelConfig(method="ulysses"), ParallelConfig(machines=2, method="torus")],
                         ids=["ulysses", "torus"])
def test_set_attn_processor_users_get_the_exact_output(pool, config):
    for res in pool.run(adapter_vs_reference, config, 3):
        assert res["routed"] == {("FluxSPAttnProcessor", "streamfusion")} and res["error"] <= TOL, res

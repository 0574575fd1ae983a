"""Every plan family through `parallelize` on 4 gloo processes matches the unparallelized model (float32).

Flux.2, Wan and Qwen-Image on every layout the issue names (torus U4R1 and U2R2, usp U2R2, ring U1R4,
ulysses U4R1, auto) and tas U2R2, and so the input images of edits (Qwen-Image-Edit, Flux.1 Kontext, Flux.2's
references, Wan 2.2 TI2V's first frame); LTX, HunyuanVideo, ChronoEdit and Helios once each; LongCat-Image, Krea-2, Z-Image,
HunyuanVideo 1.5, ChronoEdit and MiniMax-H3 (its video and audio outputs both) under Ulysses, Torus, USP, Ring,
TAS and auto, Z-Image's omni mode (input images) too;
every case with token counts that do not divide the 4 ranks (uneven slices); a text shorter than the ranks stays
whole and is attended as joint tokens where the split self-attention holds it (cross-attended, as Wan's, or
packed into the split sequence, as MiniMax-H3's, it adds none).
Key masks: kept exactly where the attention they mask stays local (LTX's cross-attention); where they mask the
split self-attention (padded prompts), taken under Ulysses (Qwen-Image, Krea-2, Z-Image: every rank attends all
keys at once) and refused naming the fix elsewhere (ring stages, HunyuanVideo's and HunyuanVideo 1.5's per-query
masks), on every rank together and within a bound, also where a rank's own slice of the mask drops no key.
"""
from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry
from plan_cases import Case, check, context, expect_error, wan_pipeline_vae

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.diffusers.plans import plan_for
from streamfusion_diffusers.diffusers.processors.backend import streamfusion_attention
from streamfusion_diffusers.diffusers.sharding import FORWARD_HOOK

WORLD = 4
LAYOUTS = {
    "torus-U4R1": dict(method="torus", ulysses=4, ring=1),
    "torus-U2R2": dict(method="torus", ulysses=2, ring=2),
    "usp-U2R2": dict(method="usp", ulysses=2, ring=2),
    "ring-U1R4": dict(method="ring"),
    "ulysses-U4R1": dict(method="ulysses"),
    "auto": dict(method="auto"),
    "tas-U2R2": dict(method="tas", ulysses=2, ring=2),
}
NEW = {  # image and text token counts that 4 does not divide
    "flux2": Case("flux2", (3, 5), text=6),
    "wan": Case("wan", (2, 3, 3), text=7),
    "qwen-image": Case("qwen-image", (3, 5), text=6, batch=2),
}
EDITS = {  # an input image's tokens after the image's, uneven over 4 ranks; Wan TI2V's first frame is its own
    "qwen-image-edit": Case("qwen-image", (3, 5), text=6, batch=2, references=((2, 3),)),
    "flux-kontext": Case("flux", (3, 5), text=6, references=((2, 3),)),
    "flux2-two-references": Case("flux2", (3, 5), text=6, references=((2, 3), (2, 2))),
    "wan2.2-ti2v-first-frame": Case("wan", (2, 3, 3), text=7, token_timesteps=True),
}
OTHERS = {
    "ltx-masked-text": Case("ltx", (2, 3, 3), text=7, batch=2, padded_text=3),
    "hunyuan-video": Case("hunyuan-video", (2, 3, 3), text=6),
    "wan2.2-token-timesteps": Case("wan", (2, 3, 3), text=7, token_timesteps=True),
    "flux2-text-shorter-than-the-ranks": Case("flux2", (3, 5), text=3),
    "hunyuan-video-text-shorter-than-the-ranks": Case("hunyuan-video", (2, 3, 3), text=3),
    "wan-text-shorter-than-the-ranks": Case("wan", (2, 3, 3), text=3),  # cross-attended only: no joint rows
    "chronoedit": Case("chronoedit", (2, 3, 3), text=7),
    "helios": Case("helios", (2, 3, 3), text=7),
}

NEWEST = {  # diffusers' newest transformers; uneven token counts, the text split, whole or joined
    "longcat-image": Case("longcat-image", (3, 5), text=6),
    "longcat-image-text-shorter-than-the-ranks": Case("longcat-image", (3, 5), text=3),
    "krea2-text-whole": Case("krea2", (3, 5), text=6),
    "z-image-one-stream": Case("z-image", (3, 5), text=7),
    "z-image-omni": Case("z-image", (3, 5), text=7, references=((2, 3),)),  # captions, latents, SigLIP; noise tags
    "hunyuan-video-1.5-padding-dropped": Case("hunyuan-video-1.5", (2, 3, 3), text=6),
    "chronoedit": Case("chronoedit", (2, 3, 3), text=7),  # diffusers' plan, as shipped
    "ltx2-audio-whole": Case("ltx2", (2, 3, 3), text=7, audio=9),  # the audio over the split video, merged
    "ltx2-padded-text-token-timesteps": Case("ltx2", (2, 3, 3), text=7, batch=2, padded_text=3, audio=11,
                                             token_timesteps=True),
    "minimax-h3-tags-uneven": Case("minimax-h3", (2, 3, 3), text=6, audio=10),  # 34 rows: 9, 9, 8, 8
    "minimax-h3-text-shorter-than-the-ranks": Case("minimax-h3", (3, 2, 3), text=3, batch=2, audio=6),
    "cosmos3-omni": Case("cosmos3", (2, 3, 3), text=7, audio=9),  # text whole; 30 video, sound, action rows
}
NEWEST_LAYOUTS = ["ulysses-U4R1", "torus-U2R2", "usp-U2R2", "ring-U1R4", "tas-U2R2", "auto"]
PADDED_NEWEST = {  # the last prompt shorter: Krea-2's text mask; Z-Image's captions of 34 and 30 tokens pad to 64
    # and 32, so the mask its forward builds drops the shorter row's tail, on the last ranks' slices only
    "krea2": Case("krea2", (3, 5), text=6, batch=2, padded_text=2),
    "z-image": Case("z-image", (3, 5), text=34, batch=2, padded_text=4),
}
BOUND_S = 60  # past this a call that waits in a collective is reported, long before the process group's timeout


def config(layout: str) -> ParallelConfig:
    return ParallelConfig(machines=2, gpus_per_machine=2, **LAYOUTS[layout])


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_new_models_match_on_every_layout(pool, layout, family):
    check(pool, config(layout), NEW[family])


@pytest.mark.parametrize("layout", ["ulysses-U4R1", "torus-U2R2"])
def test_flux2_runs_its_twins_with_rope_in_one_pass(pool, layout):
    """Flux.2's joint and single blocks run diffusers' calls step for step with RoPE in one pass (one Triton pass
    on GPUs; diffusers' function here), on the plain path and with Torus stages alike."""
    for res in check(pool, config(layout), NEW["flux2"]):
        assert res["processors"] == ["Flux2RotaryAttnProcessor", "Flux2RotaryParallelSelfAttnProcessor"], res


@pytest.mark.parametrize("case", EDITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_input_images_match_on_every_layout(pool, layout, case):
    """The reference tokens lengthen the split sequence: every rank's attention holds its share of the image's
    and the input images' tokens together (plan_cases.check counts them), and the output matches one rank's."""
    check(pool, config(layout), EDITS[case])


@pytest.mark.parametrize("case", NEWEST)
@pytest.mark.parametrize("layout", NEWEST_LAYOUTS)
def test_the_newest_models_match_on_every_method(pool, layout, case):
    check(pool, config(layout), NEWEST[case])


@pytest.mark.parametrize("case", OTHERS)
def test_other_plan_models_match(pool, case):
    check(pool, config("torus-U2R2"), OTHERS[case])


PADDED_QWEN = Case("qwen-image", (3, 5), text=6, batch=2, padded_text=2)


@pytest.mark.parametrize("text", [6, 3], ids=["text-split", "text-whole"])
def test_padded_prompts_match_under_ulysses(pool, text):
    """A batch whose last prompt is 2 tokens shorter (its key mask drops them): the unparallelized model's output,
    the text split over the ranks or, shorter than the ranks, whole on each."""
    check(pool, config("ulysses-U4R1"), Case("qwen-image", (3, 5), text=text, batch=2, padded_text=2))


@pytest.mark.parametrize("case", PADDED_NEWEST)
def test_padded_prompts_of_the_newest_models_match_under_ulysses_in_bounded_time(pool, case):
    """Every rank takes the mask together, also where its own slice keeps every key (Z-Image's first ranks): ranks
    that decided apart would wait for each other in different collectives until the group's timeout."""
    check(pool, config("ulysses-U4R1"), PADDED_NEWEST[case], wait_s=BOUND_S)


@pytest.mark.parametrize("case, said", [(PADDED_QWEN, "need every key at once on each rank, after one all-to-all: "
                                                      "method='ulysses'"),
                                        (Case("hunyuan-video", (2, 3, 3), text=6, batch=2, padded_text=2),
                                         "takes one that masks keys alike for every query and head"),
                                        (PADDED_NEWEST["krea2"], "method='ulysses'"),
                                        (PADDED_NEWEST["z-image"], "method='ulysses'"),
                                        (Case("hunyuan-video-1.5", (2, 3, 3), text=6, batch=2, padded_text=2),
                                         "takes one that masks keys alike for every query and head")],
                         ids=["qwen-image", "hunyuan-video", "krea2", "z-image", "hunyuan-video-1.5"])
def test_key_masks_of_the_split_attention_elsewhere_are_refused_naming_the_fix(pool, case, said):
    """On every rank, also where its own slice of the mask keeps every key (Z-Image's, HunyuanVideo 1.5's first
    ranks): a rank that went on alone would wait in the attention's collectives for peers that had refused."""
    errors = pool.run_within(BOUND_S, expect_error, config("torus-U2R2"), case)
    assert all(said in e for e in errors), errors


def _mask_guard(config: ParallelConfig, mask: str) -> dict:
    """On every rank: a Qwen-Image forward's key-mask check (its encoder_hidden_states_mask kept whole, or not
    given), then what its routed attention says to a mask that drops a key."""
    case = NEW["qwen-image"]
    model = case.model(0)
    parallelize(model, context(config))
    try:
        inputs = case.inputs(1)
        if mask == "absent":
            inputs["encoder_hidden_states_mask"] = None
        hook = HookRegistry.check_if_exists_or_initialize(model).get_hook(FORWARD_HOOK)
        hook.pre_forward(model, **inputs)
        route = model.transformer_blocks[0].attn.processor._parallel_config
        q = torch.zeros(1, 4, 2, 8)
        drops = torch.ones(1, 1, 1, 4, dtype=torch.bool)
        drops[..., -1] = False
        try:
            streamfusion_attention(q, q, q, attn_mask=drops, _parallel_config=route)
            answer = "taken"
        except ValueError as err:
            answer = str(err)
        return {"checked": route.state.masks_checked, "answer": answer}
    finally:
        unparallelize(model)


def test_the_attention_trusts_only_a_mask_that_was_checked(pool):
    """A key mask the forward was given and found whole is what the attention's mask was built from; with none
    given, a mask reaching the attention that drops a key is refused there, plan or no plan naming a mask input."""
    for res in pool.run(_mask_guard, config("torus-U2R2"), "whole"):
        assert res["checked"] == ("encoder_hidden_states_mask",), res
    for res in pool.run(_mask_guard, config("torus-U2R2"), "absent"):
        assert res["checked"] == () and "method='ulysses'" in res["answer"], res  # taken as a key mask


@pytest.mark.parametrize(("case", "name"), [("cosmos3-omni", "Cosmos3OmniTransformer"),
                                            ("minimax-h3-tags-uneven", "MiniMaxH3Transformer3DModel")])
def test_cfg_parallelism_without_a_guidance_batch_is_refused_naming_the_fix(pool, case, name):
    """Cosmos3's forward packs one prompt's sequence (its pipeline calls each guidance branch apart); MiniMax-H3 is
    guidance-distilled, its timestep a list of distinct values and its layout tensors without a batch dim: no
    batch for the branches to split, so parallelize refuses cfg=2 before it changes the model."""
    config = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", cfg=2)
    errors = pool.run(expect_error, config, NEWEST[case])
    assert all(f"{name}'s forward does not take: pass cfg=1" in e for e in errors), errors


def test_too_few_tokens_fail_naming_the_fix(pool):
    errors = pool.run(expect_error, config("ring-U1R4"), Case("wan", (1, 1, 3), text=7))
    assert all("3 image/video tokens cannot be split over 4 ranks; raise the resolution" in e for e in errors), errors


def test_a_wan_pipeline_decodes_its_vae_patch_parallel_and_says_so(pool):
    for res in pool.run(wan_pipeline_vae, config("torus-U2R2")):  # 6 latent rows: bands of 2, 2, 1, 1
        assert res["vae_decode"] == "patch-parallel" and res["rel"] <= 1e-5, res


def test_a_transformer_without_a_plan_is_refused_naming_what_is_supported():
    with pytest.raises(ValueError, match=r"Linear has no context-parallel plan: parallelize takes a transformer with "
                                         r"a diffusers _cp_plan .* or one of \['CogVideoXTransformer3DModel'"):
        plan_for(torch.nn.Linear(2, 2))

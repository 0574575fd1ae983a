"""Every plan family through `parallelize` on 4 gloo processes matches the unparallelized model (float32).

Flux.2, Wan and Qwen-Image on every layout the issue names (torus U4R1 and U2R2, usp U2R2, ring U1R4,
ulysses U4R1, auto); LTX, HunyuanVideo, ChronoEdit and Helios once each; every case with token counts that do not
divide the 4 ranks (uneven slices); a text shorter than the ranks stays whole and is attended as joint tokens.
Key masks: kept exactly where the attention they mask stays local (LTX's cross-attention), refused naming the
input where they would mask the split self-attention (Qwen-Image, HunyuanVideo).
"""
from __future__ import annotations

import pytest
import torch
from plan_cases import Case, check, expect_error, wan_pipeline_vae

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.commands.spawn import ProcessPool
from streamfusion_diffusers.diffusers.plans import plan_for

WORLD = 4
LAYOUTS = {
    "torus-U4R1": dict(method="torus", ulysses=4, ring=1),
    "torus-U2R2": dict(method="torus", ulysses=2, ring=2),
    "usp-U2R2": dict(method="usp", ulysses=2, ring=2),
    "ring-U1R4": dict(method="ring"),
    "ulysses-U4R1": dict(method="ulysses"),
    "auto": dict(method="auto"),
}
NEW = {  # image and text token counts that 4 does not divide
    "flux2": Case("flux2", (3, 5), text=6),
    "wan": Case("wan", (2, 3, 3), text=7),
    "qwen-image": Case("qwen-image", (3, 5), text=6, batch=2),
}
OTHERS = {
    "ltx-masked-text": Case("ltx", (2, 3, 3), text=7, batch=2, padded_text=3),
    "hunyuan-video": Case("hunyuan-video", (2, 3, 3), text=6),
    "wan2.2-token-timesteps": Case("wan", (2, 3, 3), text=7, token_timesteps=True),
    "flux2-text-shorter-than-the-ranks": Case("flux2", (3, 5), text=3),
    "hunyuan-video-text-shorter-than-the-ranks": Case("hunyuan-video", (2, 3, 3), text=3),
    "chronoedit": Case("chronoedit", (2, 3, 3), text=7),
    "helios": Case("helios", (2, 3, 3), text=7),
}


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


@pytest.mark.parametrize("case", OTHERS)
def test_other_plan_models_match(pool, case):
    check(pool, config("torus-U2R2"), OTHERS[case])


@pytest.mark.parametrize("case, name", [(Case("qwen-image", (3, 5), text=6, batch=2, padded_text=2),
                                         "encoder_hidden_states_mask"),
                                        (Case("hunyuan-video", (2, 3, 3), text=6, batch=2, padded_text=2),
                                         "encoder_attention_mask")], ids=["qwen-image", "hunyuan-video"])
def test_key_masks_of_the_split_attention_are_refused_naming_the_input(pool, case, name):
    errors = pool.run(expect_error, config("torus-U2R2"), case)
    assert all(e.startswith(f"{name} masks out some keys") for e in errors), errors


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

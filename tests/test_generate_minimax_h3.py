"""MiniMax-H3 at real size: the prompt encoded first (the Qwen3-VL freed before the transformer is built) gives the
tiny twin's video and sound the whole pipeline gives; the real-size spec counted on the meta device. Its generate
on 4 ranks and its refusals: tests/test_generate_models_p4.py."""
from __future__ import annotations

import torch

from streamfusion_diffusers.models.build import build_pipeline
from streamfusion_diffusers.models.configs import MODELS
from streamfusion_diffusers.models.full import encode_first
from streamfusion_diffusers.models.memory import pipeline_parts
from streamfusion_diffusers.models.pipelines import family_of


def test_encoding_first_gives_the_same_video_and_sound():
    """The real-size path (the Qwen3-VL freed before the transformer is built), on the tiny model: the same video
    and sound as the pipeline holding both."""
    pipe, encoded = encode_first("tiny-minimax-h3", "a red cat", 1024, dtype=torch.float32)
    assert pipe.text_encoder is None and pipe.transformer.device.type == "cpu"
    call = dict(height=64, width=64, num_inference_steps=2, output_type="pt")
    got = pipe(**encoded, generator=torch.Generator().manual_seed(0), **call)
    want = build_pipeline("tiny-minimax-h3")(prompt="a red cat", generator=torch.Generator().manual_seed(0), **call)
    assert got.frames.shape == (1, 124, 3, 64, 64) and got.audio.shape == (1, 2, 207 * 800)
    assert torch.equal(got.frames, want.frames) and torch.equal(got.audio, want.audio)


def test_real_size_is_minimax_h3s():
    """On the meta device: the 33B transformer and 27B Qwen3-VL that cannot share one GPU (so the prompt is
    encoded first), and the 16:9 canvas MiniMax-H3 makes without a keyframe."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    parts = pipeline_parts("minimax-h3")
    billions = {name: round(parts[name].total / 2 / 1e9, 1) for name in ("transformer", "text_encoder")}
    assert billions == {"transformer": 33.1, "text_encoder": 27.0}, billions
    assert family_of("minimax-h3").encode_first
    spec = MODELS["minimax-h3"]
    assert (spec.height, spec.width) == resolve_canvas_size(16, 9, 32, 768, 768 * 1344)
    assert spec.image_tokens(spec.height, spec.width, spec.frames) == 37 * 24 * 42  # 5n + 2 latent frames

"""LTX-2 at real size on one 80 GB GPU: the prompt encoded first (the Gemma 3 12B freed before the transformer is
built) gives the tiny twin's frames and sound the whole pipeline gives, classifier-free guidance on; the real-size
decision from the parts' sizes on the meta device and memory.py's peaks."""
from __future__ import annotations

import torch

from streamfusion_diffusers.models.build import build_pipeline
from streamfusion_diffusers.models.configs import MODELS
from streamfusion_diffusers.models.full import encode_first
from streamfusion_diffusers.models.memory import GIB, RUNTIME_GIB, estimate, pipeline_parts
from streamfusion_diffusers.models.pipelines import family_of


def test_encoding_first_gives_the_same_frames_and_sound():
    """The connectors stay with the transformer; the call gets both prompts' embeddings and masks."""
    spec = MODELS["tiny-ltx2"]
    pipe, encoded = encode_first("tiny-ltx2", "a red cat", spec.max_sequence_length, dtype=torch.float32)
    assert pipe.text_encoder is None and pipe.connectors is not None and pipe.transformer.device.type == "cpu"
    assert sorted(encoded) == sorted(family_of("tiny-ltx2").encoded)
    call = dict(height=64, width=64, num_inference_steps=2, output_type="pt",
                **family_of("tiny-ltx2").call_kwargs(spec, spec.frames, None, None, spec.max_sequence_length))
    assert call["guidance_scale"] > 1
    got = pipe(**encoded, generator=torch.Generator().manual_seed(0), **call)
    want = build_pipeline("tiny-ltx2")(prompt="a red cat", generator=torch.Generator().manual_seed(0), **call)
    assert got.frames.shape == (1, spec.frames, 3, 64, 64) and got.audio.shape[:2] == (1, 2)
    assert torch.equal(got.frames, want.frames) and torch.equal(got.audio, want.audio)


def test_real_size_encodes_first_to_fit_one_80_gb_gpu():
    """On the meta device: the 18.9B transformer and Gemma 3 12B; with the encoder held beside them a 720p video
    does not fit an 80 GB GPU, encoded first it does."""
    parts = pipeline_parts("ltx2")
    billions = {name: round(parts[name].total / 2 / 1e9, 1) for name in ("transformer", "text_encoder")}
    assert billions == {"transformer": 18.9, "text_encoder": 12.2}, billions
    assert family_of("ltx2").encode_first
    first = estimate("ltx2", 704, 1280, 121, 1)
    assert 80 in first.fits
    whole = first.peak + parts["text_encoder"].total / GIB  # the encoder held through the denoise and decode
    assert whole + RUNTIME_GIB > 80e9 / GIB

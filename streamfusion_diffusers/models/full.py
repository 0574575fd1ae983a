"""Whole real-size pipelines with random weights: the real transformer, text encoders and VAE, for timing whole
generations.

`build_pipeline` gives real-size models one-layer text encoders and a narrow VAE (enough to check token counts
and to run the transformer at size); a user waiting for an image also waits for T5-XXL, CLIP-L and the real VAE.
Here they are built from their real configs (the `config.json` of google/t5-v1_1-xxl, openai/clip-vit-large-patch14's
text model, and the models' VAEs), seeded, directly on the device in the target dtype.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX, DiffusionPipeline
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from .build import _default_dtype_and_device, build_pipeline
from .configs import COGVIDEOX_5B_VAE, FLUX_DEV_VAE, MODELS

T5_XXL: dict[str, Any] = {  # the encoder of google/t5-v1_1-xxl (Flux.1-dev's text_encoder_2, CogVideoX's text_encoder)
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "decoder_start_token_id": 0,
}
CLIP_L: dict[str, Any] = {  # the text model of openai/clip-vit-large-patch14 (Flux.1-dev's text_encoder)
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
}


def _t5(tokenizer: Any) -> T5EncoderModel:
    return T5EncoderModel(T5Config(**T5_XXL, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


def build_full_pipeline(name: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DiffusionPipeline:
    """MODELS[name]'s pipeline with real-size text encoders and VAE (random weights, seeded); the word-level
    tokenizers of `build_pipeline` stay (their ids are a subset of the real vocabularies)."""
    spec = MODELS[name]
    if name.startswith("tiny-"):
        raise ValueError(f"{name} has no real-size encoders or VAE; use build_pipeline for tiny models")
    pipe = build_pipeline(name, seed=seed, dtype=dtype, device=device)
    torch.manual_seed(seed + 2)
    with _default_dtype_and_device(dtype, device):
        if spec.family == "flux":
            tok = pipe.tokenizer
            parts = {"text_encoder": CLIPTextModel(CLIPTextConfig(
                         **CLIP_L, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)),
                     "text_encoder_2": _t5(pipe.tokenizer_2), "vae": AutoencoderKL(**FLUX_DEV_VAE)}
        else:
            parts = {"text_encoder": _t5(pipe.tokenizer), "vae": AutoencoderKLCogVideoX(**COGVIDEOX_5B_VAE)}
    for part in parts.values():
        part.eval()
    return type(pipe)(**{**pipe.components, **parts})


__all__ = ["CLIP_L", "T5_XXL", "build_full_pipeline"]

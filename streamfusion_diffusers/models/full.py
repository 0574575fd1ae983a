"""Whole real-size pipelines with random weights: the real transformer(s), text encoders and VAE, for timing whole
generations.

`build_pipeline` gives real-size models small text encoders (enough to check token counts and to run the
transformer at size); a user waiting for an image also waits for T5-XXL, UMT5-XXL, Qwen2.5-VL or Mistral Small
and the real VAE. Here each family's module builds them from their real configs, seeded, directly on the
device in the target dtype.
"""
from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

from .build import _default_dtype_and_device, build_pipeline
from .configs import MODELS
from .pipelines import family_of


def build_full_pipeline(name: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DiffusionPipeline:
    """MODELS[name]'s pipeline with real-size text encoders and VAE (random weights, seeded); the word-level
    tokenizers of `build_pipeline` stay (their ids are a subset of the real vocabularies)."""
    if name.startswith("tiny-"):
        raise ValueError(f"{name} has no real-size encoders or VAE; use build_pipeline for tiny models")
    pipe = build_pipeline(name, seed=seed, dtype=dtype, device=device)
    torch.manual_seed(seed + 2)
    with _default_dtype_and_device(dtype, device):
        parts = family_of(name).full(MODELS[name], pipe)
    for part in parts.values():
        part.eval()
    return type(pipe)(**{**pipe.components, **parts}, **family_of(name).pipeline_kwargs(MODELS[name]))


__all__ = ["build_full_pipeline"]

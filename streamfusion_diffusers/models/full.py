"""Whole real-size pipelines with random weights: the real transformer(s), text encoders and VAE, for timing whole
generations.

`build_pipeline` gives real-size models small text encoders (enough to check token counts and to run the
transformer at size); a user waiting for an image also waits for T5-XXL, UMT5-XXL, Qwen2.5-VL or Mistral Small
and the real VAE. Here each family's module builds them from their real configs, seeded, directly on the
device in the target dtype.
"""
from __future__ import annotations

import gc

import torch
from diffusers import DiffusionPipeline

from .build import _default_dtype_and_device, build_pipeline, build_transformers
from .configs import MODELS
from .pipelines import family_of


def build_full_pipeline(name: str, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu", transformer_device: torch.device | str | None = None,
                        park: torch.device | str | None = None) -> DiffusionPipeline:
    """MODELS[name]'s pipeline with real-size text encoders and VAE (random weights, seeded); the word-level
    tokenizers of `build_pipeline` stay (their ids are a subset of the real vocabularies). park: see
    `build_pipeline` (the encoders and VAE are made together on `device`, then moved)."""
    if name.startswith("tiny-"):
        raise ValueError(f"{name} has no real-size encoders or VAE; use build_pipeline for tiny models")
    pipe = build_pipeline(name, seed=seed, dtype=dtype, device=device, transformer_device=transformer_device,
                          park=park)
    torch.manual_seed(seed + 2)
    with _default_dtype_and_device(dtype, device):
        parts = family_of(name).full(MODELS[name], pipe)
    for part in parts.values():
        part.eval()
        if park is not None:
            part.to(park)
    return type(pipe)(**{**pipe.components, **parts}, **family_of(name).pipeline_kwargs(MODELS[name]))


def encode_first(name: str, prompt: str, max_sequence_length: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> tuple[DiffusionPipeline,
                                                                                            dict[str, torch.Tensor]]:
    """The real-size pipeline of a family whose text encoder and transformer do not fit one GPU together
    (`PipelineFamily.encode_first`, Flux.2-dev): the prompt encoded, the encoder freed, then the transformer built
    (the same weights as `build_full_pipeline`'s; a tiny model's as `build_pipeline`'s). Returns the pipeline,
    without its text encoder, and the call arguments that stand for the prompt (`PipelineFamily.encoded`: the
    embeddings, and where the call takes them, their mask and the negative prompt's)."""
    build = build_pipeline if name.startswith("tiny-") else build_full_pipeline
    pipe = build(name, seed=seed, dtype=dtype, device=device, transformer_device="meta")
    with torch.inference_mode():
        outputs = pipe.encode_prompt(prompt=prompt, device=torch.device(device),
                                     max_sequence_length=max_sequence_length)
    encoded = dict(zip(family_of(name).encoded, outputs))
    pipe.register_modules(text_encoder=None)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    pipe.register_modules(**build_transformers(name, seed=seed, dtype=dtype, device=device))
    return pipe, encoded


__all__ = ["build_full_pipeline", "encode_first"]

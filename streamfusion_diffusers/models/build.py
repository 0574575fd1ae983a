"""Models and whole pipelines built offline with random weights, for tests, the demo and real-size timing runs.

No model hub is needed: transformers come from a config dict, text encoders and VAEs are small ones whose
output sizes match what the transformer expects (each family's module in `pipelines/` says how), and
tokenizers are word-level ones made here (`tokenizers.py`). The same seed gives the same weights on every
rank. Users with real weights load them with `load_pipeline`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import CogVideoXTransformer3DModel, DiffusionPipeline, FluxTransformer2DModel

from .configs import MODELS
from .pipelines import family_of


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device | str) -> Iterator[None]:
    """Create parameters directly in their final dtype and device: a real-size model never sits in float32 on CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_transformer(name_or_config: str | dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> torch.nn.Module:
    """A MODELS name's transformer, or a Flux / CogVideoX one from a config dict, with seeded random weights
    (the other families' from a dict: `models.inputs.build`)."""
    if isinstance(name_or_config, str):
        cls, config = family_of(name_or_config).transformer, MODELS[name_or_config].transformer
    else:
        config = name_or_config
        cls = FluxTransformer2DModel if "num_single_layers" in config else CogVideoXTransformer3DModel
    torch.manual_seed(seed)
    with _default_dtype_and_device(dtype, device):
        model = cls(**config)
    return model.eval()


def build_transformers(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu", park: torch.device | str | None = None
                       ) -> dict[str, torch.nn.Module]:
    """Every transformer component of MODELS[name]'s pipeline (Wan 2.2 A14B's two experts: seeds seed, seed + 1).
    park: where each goes once built (see `build_pipeline`)."""
    names = family_of(name).transformer_names(MODELS[name])
    return {part: _parked(build_transformer(name, seed=seed + i, dtype=dtype, device=device), park)
            for i, part in enumerate(names)}


def _parked(module: torch.nn.Module, park: torch.device | str | None) -> torch.nn.Module:
    return module if park is None else module.to(park)


def build_pipeline(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", transformer_device: torch.device | str | None = None,
                   park: torch.device | str | None = None) -> DiffusionPipeline:
    """MODELS[name]'s whole pipeline around its transformer(s), all weights random (seeded).

    Text encoders are small, of the width the transformer takes; the VAE has the real latent channels and
    the spec's compression (the real one for real-size models), so token counts match a real run at that size.
    transformer_device "meta": the transformers hold no memory (`full.encode_first` builds them later).
    park: where each part goes as soon as it is built (host memory, for weights to be sharded over GPUs that
    cannot hold them all): the weights are made on `device` (a GPU makes them in seconds where the CPU takes
    minutes, and with its generator, so they equal a build on that GPU), one part on it at a time.
    """
    spec = MODELS[name]
    transformers = build_transformers(name, seed=seed, dtype=dtype, device=transformer_device or device, park=park)
    torch.manual_seed(seed + len(transformers))  # the seed after the transformers'
    with _default_dtype_and_device(dtype, device):
        pipe = family_of(name).tiny(spec, transformers)
    for part_name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            component.eval()  # built in training mode: T5's dropout would make every run differ
            if part_name not in transformers:
                _parked(component, park)
    return pipe


def load_pipeline(name: str, weights: str, *, dtype: torch.dtype, device: torch.device | str) -> DiffusionPipeline:
    """Real weights: a hub id or a local folder in diffusers' layout (what users normally run)."""
    return family_of(name).pipeline.from_pretrained(weights, torch_dtype=dtype).to(device)

"""Model configs (real and tiny) and offline builders for transformers and whole pipelines."""
from __future__ import annotations

from .build import build_pipeline, build_transformer, load_pipeline
from .configs import COGVIDEOX_5B, FLUX_DEV, MODELS, TINY_COGVIDEOX, TINY_FLUX, ModelSpec

__all__ = ["COGVIDEOX_5B", "FLUX_DEV", "MODELS", "TINY_COGVIDEOX", "TINY_FLUX", "ModelSpec", "build_pipeline",
           "build_transformer", "load_pipeline"]

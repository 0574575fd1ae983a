"""The model registry and configs (real and tiny); the offline builders are in `streamfusion_diffusers.models.build`.

Only plain dicts here (and `pipelines/`, which imports diffusers only to build), so the CLI can check a layout
against a model without importing diffusers.
"""
from __future__ import annotations

from .configs import (COGVIDEOX_5B, FAMILIES, FLUX_DEV, MODELS, TINY, TINY_COGVIDEOX, TINY_FLUX, TINY_FLUX2,
                      TINY_QWEN_IMAGE, TINY_WAN, TRANSFORMERS, ModelFamily, ModelSpec, TransformerSpec, register_model)

__all__ = ["COGVIDEOX_5B", "FAMILIES", "FLUX_DEV", "MODELS", "TINY", "TINY_COGVIDEOX", "TINY_FLUX", "TINY_FLUX2",
           "TINY_QWEN_IMAGE", "TINY_WAN", "TRANSFORMERS", "ModelFamily", "ModelSpec", "TransformerSpec",
           "register_model"]

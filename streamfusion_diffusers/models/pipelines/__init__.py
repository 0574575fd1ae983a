"""The pipeline families, one module each (`base.PipelineFamily` says what a family knows)."""
from __future__ import annotations

from ..configs import MODELS
from .base import PipelineFamily
from .cogvideox import FAMILY as COGVIDEOX
from .flux import FAMILY as FLUX
from .flux2 import FAMILY as FLUX2
from .flux_kontext import FAMILY as FLUX_KONTEXT
from .qwen_image import FAMILY as QWEN_IMAGE
from .qwen_image_edit import FAMILY as QWEN_IMAGE_EDIT
from .wan import FAMILY as WAN

FAMILIES: dict[str, PipelineFamily] = {f.name: f for f in (FLUX, COGVIDEOX, WAN, QWEN_IMAGE, FLUX2, QWEN_IMAGE_EDIT,
                                                         FLUX_KONTEXT)}


def family_of(model: str) -> PipelineFamily:
    """The family of a MODELS name."""
    return FAMILIES[MODELS[model].family]


__all__ = ["FAMILIES", "PipelineFamily", "family_of"]

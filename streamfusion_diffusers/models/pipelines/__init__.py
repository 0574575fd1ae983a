"""The pipeline families, one module each (`base.PipelineFamily` says what a family knows); the model registry
(models/configs.py) names each family's module."""
from __future__ import annotations

from importlib import import_module

from ..configs import FAMILIES, MODELS
from .base import PipelineFamily


def adapter(family: str) -> PipelineFamily:
    """The pipeline adapter of a registered family: its module's FAMILY (imported on first use)."""
    module = FAMILIES[family].pipeline
    if module is None:
        raise ValueError(f"model family {family!r} has no pipeline: parallelize its transformer in a pipeline of "
                         f"your own")
    return import_module(f"{__name__}.{module}").FAMILY


def family_of(model: str) -> PipelineFamily:
    """The pipeline adapter of a MODELS name."""
    return adapter(MODELS[model].family)


__all__ = ["PipelineFamily", "adapter", "family_of"]

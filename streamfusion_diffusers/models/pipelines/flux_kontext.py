"""Flux.1 Kontext (`FluxKontextPipeline`): Flux.1's transformer and text encoders, the input image's latents
packed after the generated image's tokens (one sequence, split as one; their position ids' first axis says
which is which). The pipeline resizes the input image to the nearest of Kontext's trained sizes (about 1024 x
1024) unless `_auto_resize` is off, as the tiny model runs it (its input keeps its own size)."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import ModelSpec
from .flux import Flux


class FluxKontext(Flux):
    name, pipeline_class = "flux-kontext", "FluxKontextPipeline"

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline(**super().tiny(spec, transformers).components)

    def size_kwargs(self, height: int, width: int) -> dict[str, Any]:
        return {"max_area": height * width}  # else the pipeline scales the asked size to 1024 x 1024 pixels

    def image_kwargs(self, spec: ModelSpec, images: list[Any]) -> dict[str, Any]:
        return {**super().image_kwargs(spec, images), "_auto_resize": spec.extras.get("auto_resize", True)}


FAMILY = FluxKontext()

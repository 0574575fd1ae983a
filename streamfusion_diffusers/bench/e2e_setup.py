"""One workload of `bench --level e2e`: the systems it can time, what every system generates (the same prompt,
seed, size and steps), and the pipeline every rank builds for it (`e2e.py` runs and times the systems)."""
from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..core.config import degrees_label
from ..runtime import images
from ..models import MODELS
from ..models.build import build_pipeline
from ..models.full import build_full_pipeline, encode_first
from ..models.pipelines import family_of
from . import cachedit


OURS = ("ours", "ours-no-vae-split", "ours-cfg")
BASELINES = ("diffusers-cp", "xfuser", *cachedit.SYSTEMS)  # each takes a fresh transformer, changed for good


@dataclass(frozen=True)
class E2ECase:
    """One timed system; baselines carry their Ulysses x Ring degrees and CFG degree."""

    system: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def label(self) -> str:
        if self.system in BASELINES:
            return f"{self.system} {'cfg2 ' if self.cfg > 1 else ''}{degrees_label(self.ulysses, self.ring)}"
        return self.system


@dataclass(frozen=True)
class E2ESetup:
    """One workload's generation, the same for every system."""

    name: str
    model: str  # a models.MODELS key
    full: bool  # real-size text encoders and VAE
    height: int
    width: int
    frames: int
    steps: int
    guidance_scale: float
    true_cfg_scale: float | None
    max_sequence_length: int
    prompt: str
    seed: int
    dtype: torch.dtype
    machines: int
    gpus_per_machine: int
    backend: str = "torch"
    recipe: str | None = None
    comm_dtype: str | None = None
    emulate_link: str | None = None  # ours only: the inter-machine link its transfers are slowed to
    iters: int = 3
    warmup: int = 1
    timeout_s: float = 300.0
    prompt_embeds: Tensor | None = None  # the prompt encoded before the transformer was built (Flux.2-dev)

    def call(self, output_type: str) -> dict[str, Any]:
        spec = MODELS[self.model]
        prompt = {"prompt": self.prompt} if self.prompt_embeds is None else {"prompt_embeds": self.prompt_embeds}
        return dict(**prompt, height=self.height, width=self.width, num_inference_steps=self.steps,
                    generator=torch.Generator("cpu").manual_seed(self.seed), output_type=output_type,
                    **family_of(self.model).call_kwargs(spec, self.frames, self.guidance_scale, self.true_cfg_scale,
                                                        self.max_sequence_length),
                    **family_of(self.model).size_kwargs(self.height, self.width), **self.input_image())

    def input_image(self) -> dict[str, Any]:
        """An edit model's input image: a blank one of the output's size (its tokens are what an edit adds)."""
        family = family_of(self.model)
        if not family.needs_image:
            return {}
        return family.image_kwargs(MODELS[self.model], [images.decode(images.blank(self.width, self.height))])


def build(setup: E2ESetup, device: torch.device) -> tuple[Any, E2ESetup]:
    """The workload's pipeline, and the setup to call it with: a family whose real-size encoder and transformer do
    not fit one GPU together (Flux.2) is encoded first, tiny or real, as `streamfusion generate` does at real size,
    and every generation takes the embeddings."""
    gc.collect()  # the previous workload's pipeline: its hooks form reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if family_of(setup.model).encode_first:
        pipe, embeds = encode_first(setup.model, setup.prompt, setup.max_sequence_length, seed=setup.seed,
                                    dtype=setup.dtype, device=device)
        setup = replace(setup, prompt_embeds=embeds)
    else:
        build = build_full_pipeline if setup.full else build_pipeline
        pipe = build(setup.model, seed=setup.seed, dtype=setup.dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, setup


__all__ = ["BASELINES", "OURS", "E2ECase", "E2ESetup", "build"]

"""Which requests run as one pipeline call, and how that call is laid out.

Requests of the same pipeline-call shape (size, frames, steps, guidance, negative prompt, LoRAs) run together: their
images are one batch through the transformer, and each prompt is encoded once (`num_images_per_prompt`). Every
image keeps its own seeded CPU generator (diffusers draws each latent of a generator list on its own), so an
image in a batch is the image its request gives alone. Where a batch could change an image, requests run alone:
a step cache decides whether to skip a step from the whole batch's change, and a family whose prompt tokens are
unpadded (Qwen-Image) would pad shorter prompts (masked keys: the same image up to rounding, not the same pixels),
so it batches only requests of one prompt. Videos run one per call: a video in a batch was seen one level off in places.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.pipelines import family_of
from .job import Job
from .request import Request

DEFAULT_MAX_BATCH = 8  # images per pipeline call when the memory plan says nothing (the CPU's tiny models)


def max_batch(job: Job) -> int:
    """The most images one pipeline call of the job takes (`serve --max-batch`'s default)."""
    return DEFAULT_MAX_BATCH


def unbatched_why(job: Job) -> str | None:
    """Why the job's requests must each run alone (their images would differ in a batch), else None."""
    if job.stack.cache is not None:
        return f"--cache {job.stack.cache.name} decides each step's skip from the whole batch"
    if job.spec.video:  # tiny-wan on 4 gloo ranks: frames up to one level apart from the video made alone
        return "a video made in a batch is not yet the video made alone"
    return None


def batch_key(job: Job, request: Request) -> tuple:
    """Requests with equal keys can share a pipeline call."""
    if family_of(job.model).joint_text(job.spec, job.max_sequence_length) is None:
        return (*request.shape, request.prompt)  # unpadded prompt tokens: one prompt per call
    return request.shape


@dataclass(frozen=True)
class CallPlan:
    """One pipeline call for a batch: what to pass, and where each image lands.

    Images are numbered in request order (request 0's n images, then request 1's, ...); the call makes them in
    `order` (image `order[j]` is the call's j-th output), grouped by prompt so that each prompt is encoded once.
    """

    prompt: str | list[str]
    per_prompt: int  # num_images_per_prompt
    seeds: list[int]  # in call order
    order: list[int]

    def kwargs(self, video: bool) -> dict[str, Any]:
        """The prompt, image (video) count and generators of the call (one seeded CPU generator per image)."""
        import torch

        generators = [torch.Generator("cpu").manual_seed(s) for s in self.seeds]
        return {"prompt": self.prompt, f"num_{'videos' if video else 'images'}_per_prompt": self.per_prompt,
                "generator": generators[0] if len(generators) == 1 else generators}

    def unshuffle(self, outputs: list) -> list:
        """The call's outputs back in request order."""
        found: list = [None] * len(outputs)
        for j, image in enumerate(outputs):
            found[self.order[j]] = image
        return found


def call_plan(batch: list[Request]) -> CallPlan:
    """Each distinct prompt once with num_images_per_prompt where every prompt has as many images, else one
    prompt per image (the encoder then sees a repeated prompt more than once; the images are the same)."""
    images = [(r.prompt, r.seed + i) for r in batch for i in range(r.n)]
    groups: dict[str, list[int]] = {}
    for index, (prompt, _) in enumerate(images):
        groups.setdefault(prompt, []).append(index)
    counts = {len(g) for g in groups.values()}
    if len(counts) == 1:
        order = [i for g in groups.values() for i in g]
        prompts = list(groups)
        return CallPlan(prompts[0] if len(prompts) == 1 else prompts, counts.pop(),
                        [images[i][1] for i in order], order)
    return CallPlan([p for p, _ in images], 1, [s for _, s in images], list(range(len(images))))


__all__ = ["CallPlan", "batch_key", "call_plan", "max_batch", "unbatched_why"]

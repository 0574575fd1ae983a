"""One request to a job's ranks: what a generation asks for beyond the job it runs on."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from .job import Job

_IDS = itertools.count(1)


def _next_id() -> str:
    """A request id unique in this process (the front's): what progress, cancels and logs name a request by."""
    return f"req-{next(_IDS)}"


@dataclass(frozen=True)
class Request:
    """What every rank of a group runs: `n` generations (image i with seed + i) of one prompt and size."""

    prompt: str
    negative_prompt: str | None
    height: int
    width: int
    frames: int
    steps: int
    seed: int
    guidance_scale: float | None
    n: int = 1
    lora: tuple[tuple[str, float], ...] = ()  # the named adapters (serve --lora NAME=PATH) it runs, with weights
    partial_images: int = 0  # previews rank 0 draws while it runs (progress.py); the images are the same
    images: tuple[bytes, ...] = ()  # input images' files (runtime/images.py): an edit's, references, a first frame
    id: str = field(default_factory=_next_id)

    @classmethod
    def of(cls, job: Job) -> Request:
        """The job's own generation as a request (what `generate` runs; its named adapters on, each at its scale)."""
        return cls(prompt=job.prompt, negative_prompt=None, height=job.height, width=job.width, frames=job.frames,
                   steps=job.steps, seed=job.seed, guidance_scale=job.guidance_scale, images=job.images,
                   lora=tuple((str(a.name), a.scale) for a in job.stack.adapters))

    def job(self, base: Job, index: int = 0) -> Job:
        """The job with this request's prompt, size, steps and seed (generation `index`: seed + index)."""
        return dataclasses.replace(base, prompt=self.prompt, height=self.height, width=self.width,
                                   frames=self.frames, steps=self.steps, seed=self.seed + index,
                                   guidance_scale=self.guidance_scale)

    @property
    def shape(self) -> tuple:
        """What the pipeline call is shaped by: requests that share it can run as one call (runtime/batch.py)."""
        return (self.height, self.width, self.frames, self.steps, self.guidance_scale, self.negative_prompt,
                self.lora, self.images)  # one call takes one set of adapters and of input images

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


__all__ = ["Request"]

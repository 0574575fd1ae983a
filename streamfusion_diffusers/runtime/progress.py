"""What rank 0 tells the front at each step's end, and the small previews it may add.

A step's note says which requests run, the step done, the steps, and the seconds since the call began; it costs one
put on the pool's queue, so a call nobody watches runs as fast as before. A request may ask for previews
(`partial_images`, 0-3): at the steps `preview_steps` picks, rank 0 turns that request's latents into a small RGB
image (one pixel per latent pixel) by a linear map from the latent channels to RGB.

The map is the model's own: least squares of the warm-up generation's final latents against its decoded image,
pooled to the latent grid, fitted once when the group starts. It costs no extra decode (the warm-up decodes anyway)
and one matrix product per preview; a tiny decoder would draw better previews but needs weights this model does not
ship, and the full VAE decode is collective (split over the ranks) and costs a real decode per preview. The map is
an approximation: colours the warm-up image lacks come out less faithful.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# pipelines whose packed latents unpack to an image grid (_unpack_latents); an edit's step latents are its output's
# only (its input image's enter each step beside them)
PREVIEW_FAMILIES = ("flux", "flux-kontext", "qwen-image", "qwen-image-edit")


@dataclass(frozen=True)
class StepNote:
    """Rank 0's note at a step's end: `previews` maps a request id to its preview (H/8 x W/8 x 3 uint8)."""

    ids: list[str]
    step: int
    steps: int
    elapsed_s: float
    previews: dict[str, np.ndarray] = field(default_factory=dict)


def preview_steps(steps: int, partial_images: int) -> set[int]:
    """The steps (1-based, before the last) after which a preview is drawn: evenly spread, at most `partial_images`
    (fewer when there are fewer steps, as OpenAI's final image may come before every partial one)."""
    return {steps * (k + 1) // (partial_images + 1) for k in range(partial_images)} - {0, steps}


def latent_grid(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The pipeline's packed latents (batch, tokens, channels x 4) as an image grid (batch, channels, h, w)."""
    grid = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    return grid[:, :, 0] if grid.ndim == 5 else grid  # Qwen-Image's VAE takes a frame axis


class LatentToRgb:
    """A linear map (channels + 1) x 3 from latent channels to RGB in [0, 1], fitted on one latent and its image."""

    def __init__(self, grid: torch.Tensor, image: np.ndarray):
        """`grid`: (channels, h, w); `image`: (H, W, 3) uint8, H and W multiples of h and w."""
        h, w = grid.shape[1:]
        fh, fw = image.shape[0] // h, image.shape[1] // w  # pixels per latent pixel
        pooled = image[:h * fh, :w * fw].reshape(h, fh, w, fw, 3).mean(axis=(1, 3)) / 255.0
        inputs = self._inputs(grid)
        self.weights = np.linalg.lstsq(inputs, pooled.reshape(-1, 3), rcond=None)[0]

    @staticmethod
    def _inputs(grid: torch.Tensor) -> np.ndarray:
        flat = grid.detach().float().cpu().reshape(grid.shape[0], -1).T.numpy()
        return np.concatenate([flat, np.ones((flat.shape[0], 1), dtype=flat.dtype)], axis=1)

    def __call__(self, grid: torch.Tensor) -> np.ndarray:
        """(channels, h, w) -> (h, w, 3) uint8."""
        rgb = self._inputs(grid) @ self.weights
        return (np.clip(rgb, 0.0, 1.0) * 255).round().astype(np.uint8).reshape(grid.shape[1], grid.shape[2], 3)


__all__ = ["PREVIEW_FAMILIES", "LatentToRgb", "StepNote", "latent_grid", "preview_steps"]

"""The previews' parts on their own: which steps draw one, and the latent-to-RGB map, checked against numpy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamfusion_diffusers.runtime.progress import LatentToRgb, preview_steps


@pytest.mark.parametrize("steps, partial, want", [(5, 2, {1, 3}), (20, 3, {5, 10, 15}), (4, 1, {2}), (1, 3, set()),
                                                  (2, 3, {1}), (30, 0, set())])
def test_preview_steps_are_spread_before_the_last(steps, partial, want):
    assert preview_steps(steps, partial) == want


def test_the_map_recovers_a_linear_latent_to_rgb_relation():
    """An image that is a known affine function of the latent (8 x 8 pixels per latent pixel) is drawn back
    within three levels of the truth at every latent pixel, on a latent the map was not fitted on."""
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.05, (17, 3))
    weights[-1] = 0.5

    def truth(grid: np.ndarray) -> np.ndarray:  # (16, h, w) -> (h, w, 3) in [0, 1]
        return np.clip(np.einsum("chw,cr->hwr", grid, weights[:-1]) + weights[-1], 0, 1)

    grid = rng.normal(0, 1, (16, 12, 10))
    image = (np.kron(truth(grid), np.ones((8, 8, 1))) * 255).round().astype(np.uint8)
    fitted = LatentToRgb(torch.from_numpy(grid), image)
    other = rng.normal(0, 1, (16, 6, 7))
    drawn = fitted(torch.from_numpy(other))
    assert drawn.shape == (6, 7, 3) and drawn.dtype == np.uint8
    assert np.abs(drawn.astype(float) - truth(other) * 255).max() <= 3.0

"""What the pixels become: a pipeline's "pt" images made 8-bit on their device as its "pil" output makes them
(diffusers' numpy path on the CPU), pixel for pixel."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from streamfusion_diffusers.runtime.output import to_pil


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_pil_makes_the_pipelines_pil_images(dtype):
    from diffusers.image_processor import VaeImageProcessor

    decoded = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(0)) * 2.2 - 1.1  # past [-1, 1] too
    decoded[0, :, 0, :8] = (torch.arange(8) + 0.5) / 255 * 2 - 1  # x 255 lands on a half: rounded to even
    decoded = decoded.to(dtype)
    processor = VaeImageProcessor()
    made = to_pil(processor.postprocess(decoded, output_type="pt"))
    expected = processor.postprocess(decoded, output_type="pil")
    assert [m.mode for m in made] == [e.mode for e in expected] == ["RGB"] * 3
    for m, e in zip(made, expected):
        assert np.array_equal(np.asarray(m), np.asarray(e))

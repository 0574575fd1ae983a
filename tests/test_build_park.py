"""Random-weight pipelines made on one device and parked on another, a part at a time (a sharded real-size run:
made on its GPU, held in host memory until sharded): every part ends where it is parked, with the weights a build
on the making device gives."""
from __future__ import annotations

import pytest
import torch

from streamfusion_diffusers.models.build import build_pipeline


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {name: part for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)}


def test_every_part_ends_where_it_is_parked():
    parked = _modules(build_pipeline("tiny-flux2", seed=3, device="cpu", park="meta"))
    assert {"transformer", "text_encoder", "vae"} <= parked.keys()
    for name, part in parked.items():
        assert {p.device.type for p in part.parameters()} == {"meta"}, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny-flux2", "tiny-wan-a14b"])
def test_parts_made_on_the_gpu_and_parked_in_host_memory_keep_the_gpus_weights(name):
    made = _modules(build_pipeline(name, seed=3, device="cuda"))
    parked = _modules(build_pipeline(name, seed=3, device="cuda", park="cpu"))
    assert made.keys() == parked.keys()
    for part in made:
        for (key, a), (_, b) in zip(made[part].state_dict().items(), parked[part].state_dict().items()):
            assert b.device.type == "cpu" and torch.equal(a.cpu(), b), (part, key)

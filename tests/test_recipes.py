"""Packaged recipes load, every entry resolves to a valid layout, and lookups fail with the fix."""
from __future__ import annotations

import pytest

from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.core.config import resolve_layout

HEADS = {"flux-dev": 24, "cogvideox-5b": 48}


@pytest.mark.parametrize("model", sorted(HEADS))
def test_every_entry_is_a_valid_layout(model):
    recipe = load_recipe(model)
    assert recipe.model == model and recipe.entries
    for e in recipe.entries:
        size = {k: e[k] for k in ("resolution", "frames") if k in e}
        config = recipe.config(e["machines"], e["gpus_per_machine"], e.get("link"), **size)
        layout = resolve_layout(config, e["machines"] * e["gpus_per_machine"], HEADS[model])
        assert (layout.method, layout.ulysses, layout.ring) == (e["method"], e["ulysses"], e["ring"])
        assert e["source"] in ("measured", "cost model")


def test_nearest_size_and_errors(tmp_path):
    recipe = load_recipe("flux-dev")
    assert recipe.entry(2, 8, resolution=2100)["resolution"] == 2048
    with pytest.raises(ValueError, match="no entry for 3 x 8 GPUs.*covers"):
        recipe.entry(3, 8, resolution=2048)
    with pytest.raises(ValueError, match="use one of cogvideox-5b, flux-dev"):
        load_recipe("sdxl")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nentries:\n- {machines: 1}\n")
    with pytest.raises(ValueError, match="lacks gpus_per_machine, method"):
        load_recipe(str(bad))
    own = tmp_path / "own.yaml"
    own.write_text("model: flux-dev\nentries:\n- {machines: 1, gpus_per_machine: 4, method: torus, ulysses: 4}\n")
    assert load_recipe(str(own)).config(1, 4).method == "torus"

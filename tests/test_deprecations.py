"""What moved or goes keeps working for one release with a DeprecationWarning naming the replacement: every old
module path in _moved.MOVED imports as the very module at its new path; parallelize(waves=...), retired, raises naming the alternative."""
from __future__ import annotations

import importlib
import sys

import pytest

from streamfusion_diffusers._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_path_imports_the_new_module_and_warns(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=MOVED[old]):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_old_recipes_names_warn_and_still_load():
    from streamfusion_diffusers.choice.recipe import load_recipe

    recipes = importlib.import_module("streamfusion_diffusers.recipes")  # the package stays (the loader left it)
    with pytest.warns(DeprecationWarning, match="streamfusion_diffusers.choice.recipe.load_recipe"):
        assert recipes.load_recipe is load_recipe


@pytest.mark.parametrize("waves", [2, "auto", 1])
def test_waves_are_retired_naming_the_alternative(waves):
    from streamfusion_diffusers import parallelize

    with pytest.raises(ValueError, match=r"retired.*cuda_graph=True.*torch.compile"):
        parallelize(None, None, waves=waves)  # refused first, before the target is looked at


def test_nothing_imports_the_wave_code():
    import streamfusion_diffusers.diffusers as integrations

    for name in ("waves", "wave_blocks"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"streamfusion_diffusers.diffusers.{name}")
        assert not hasattr(integrations, name)

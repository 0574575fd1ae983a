"""What moved or goes keeps working for one release with a DeprecationWarning naming the replacement: every old
module path in _moved.MOVED imports as the very module at its new path; parallelize(waves=...) warns."""
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


def test_waves_warns_naming_the_replacement():
    from streamfusion_diffusers.parallelize import parallelize

    with pytest.warns(DeprecationWarning, match="cuda_graph=True"), pytest.raises(ValueError):
        parallelize(None, None, waves=2)  # the warning comes first, before the target is looked at

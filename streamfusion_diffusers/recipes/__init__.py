"""The `tune` command's folder (the layout choice it feeds moved to streamfusion_diffusers.choice).

The loader once here (`load_recipe`, `load_recipes`, `Recipe`) is streamfusion_diffusers.choice.recipe now; the
old names still import from here for one release, with a DeprecationWarning.
"""
from .._moved import forward

__getattr__ = forward(__name__, "streamfusion_diffusers.choice.recipe")

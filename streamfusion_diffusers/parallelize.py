"""Deprecated module path: `parallelize` and `unparallelize` are at the package root
(`from streamfusion_diffusers import parallelize`); their module is `streamfusion_diffusers.diffusers.parallel_pipeline`.

Importing this module binds the package's `parallelize` attribute to it (Python sets a submodule on its
parent), so it is callable as the function is: `from streamfusion_diffusers import parallelize` then works
either way.
"""
import sys
import types
import warnings

from .diffusers.parallel_pipeline import parallelize, unparallelize

warnings.warn("streamfusion_diffusers.parallelize (the module) is deprecated: use "
              "`from streamfusion_diffusers import parallelize, unparallelize`", DeprecationWarning, stacklevel=2)


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__all__ = ["parallelize", "unparallelize"]

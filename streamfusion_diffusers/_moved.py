"""Old import paths of moved modules: each still imports, for one release, as the module at its new path,
with a DeprecationWarning naming that path.

An import finder (installed by the package's __init__) answers only for the names in MOVED, so no file stays
behind at an old path: the moves stay plain renames that history and merges follow.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

# old dotted module -> new dotted module (one release; remove the entry with the old path)
MOVED = {
    "streamfusion_diffusers.bench.costmodel": "streamfusion_diffusers.choice.costmodel",
    "streamfusion_diffusers.bench.timing": "streamfusion_diffusers.commands.timing",
    "streamfusion_diffusers.bench.workloads": "streamfusion_diffusers.choice.workloads",
    "streamfusion_diffusers.cfg": "streamfusion_diffusers.diffusers.cfg",
    "streamfusion_diffusers.commands.cli": "streamfusion_diffusers.cli",
    "streamfusion_diffusers.commands.job": "streamfusion_diffusers.runtime.job",
    "streamfusion_diffusers.commands.phases": "streamfusion_diffusers.runtime.phases",
    "streamfusion_diffusers.commands.spawn": "streamfusion_diffusers.runtime.pool",
    "streamfusion_diffusers.commands.tune": "streamfusion_diffusers.bench.tune",
    "streamfusion_diffusers.compiled": "streamfusion_diffusers.diffusers.compiled",
    "streamfusion_diffusers.config": "streamfusion_diffusers.core.config",
    "streamfusion_diffusers.core.context": "streamfusion_diffusers.context",
    "streamfusion_diffusers.generate": "streamfusion_diffusers.commands.generate",
    "streamfusion_diffusers.graphs": "streamfusion_diffusers.diffusers.graphs",
    "streamfusion_diffusers.job": "streamfusion_diffusers.runtime.job",
    "streamfusion_diffusers.launch": "streamfusion_diffusers.commands.launch",
    "streamfusion_diffusers.links": "streamfusion_diffusers.core.links",
    "streamfusion_diffusers.logs": "streamfusion_diffusers.core.logs",
    "streamfusion_diffusers.mesh": "streamfusion_diffusers.core.mesh",
    "streamfusion_diffusers.phases": "streamfusion_diffusers.runtime.phases",
    "streamfusion_diffusers.plan": "streamfusion_diffusers.commands.plan",
    "streamfusion_diffusers.processors": "streamfusion_diffusers.diffusers.processors",
    "streamfusion_diffusers.processors.base": "streamfusion_diffusers.diffusers.processors.base",
    "streamfusion_diffusers.processors.cogvideox": "streamfusion_diffusers.diffusers.processors.cogvideox",
    "streamfusion_diffusers.processors.flux": "streamfusion_diffusers.diffusers.processors.flux",
    "streamfusion_diffusers.recipes.calibrate": "streamfusion_diffusers.choice.calibrate",
    "streamfusion_diffusers.recipes.choose": "streamfusion_diffusers.choice.choose",
    "streamfusion_diffusers.recipes.predictions": "streamfusion_diffusers.choice.predictions",
    "streamfusion_diffusers.recipes.regenerate": "streamfusion_diffusers.choice.regenerate",
    "streamfusion_diffusers.recipes.rules": "streamfusion_diffusers.choice.rules",
    "streamfusion_diffusers.recipes.store": "streamfusion_diffusers.choice.store",
    "streamfusion_diffusers.recipes.tune": "streamfusion_diffusers.bench.tune",
    "streamfusion_diffusers.sequence": "streamfusion_diffusers.core.sequence",
    "streamfusion_diffusers.sharding": "streamfusion_diffusers.diffusers.sharding",
    "streamfusion_diffusers.spawn": "streamfusion_diffusers.runtime.pool",
    "streamfusion_diffusers.vae": "streamfusion_diffusers.diffusers.vae.tiles",
    "streamfusion_diffusers.vae_parallel": "streamfusion_diffusers.diffusers.vae.bands",
    "streamfusion_diffusers.verify": "streamfusion_diffusers.commands.verify",
}
# old package -> the module its own names (not its submodules) moved to: the old package imports as an empty
# package whose names come from there, and its old submodules through MOVED
EMPTIED = {
    "streamfusion_diffusers.recipes": "streamfusion_diffusers.choice.recipe",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}: import it from there (the old path goes in the next release)",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path (the same module object, not a copy), or, for an emptied
    package, as an empty package whose names come from its new module."""

    def __init__(self, new: str, emptied: bool = False):
        self.new, self.emptied = new, emptied

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.emptied:
            module.__path__ = []  # a package, so that its old submodules are looked up (and found in MOVED)
            module.__getattr__ = forward(module.__name__, self.new)
            return
        _warn(module.__name__, self.new)
        sys.modules[module.__name__] = importlib.import_module(self.new)  # the import system returns this entry


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names in MOVED. Asked first: where a package moved, its old submodule names must not be
    found again as files in the new folder (a second copy of each module)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in EMPTIED:
            return importlib.machinery.ModuleSpec(fullname, _Alias(EMPTIED[fullname], emptied=True), is_package=True)
        new = MOVED.get(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new)) if new else None


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def forward(old: str, new: str):
    """A module `__getattr__` for a package whose contents moved: names not found in it come from `new`."""

    def __getattr__(name: str) -> Any:
        module = importlib.import_module(new)
        if name.startswith("__") or not hasattr(module, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        _warn(f"{old}.{name}", f"{new}.{name}")
        return getattr(module, name)

    return __getattr__

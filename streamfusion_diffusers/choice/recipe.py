"""Recipes: the YAML tables (in recipes/ beside this module) that pin (model, size, cluster shape) to a parallel layout.

A recipe file holds one model's entries; each entry names the cluster shape (machines, gpus_per_machine), the
workload size (`resolution` for images, `frames` for video) and the layout (method, ulysses, ring, torus,
backend), plus where the choice came from (`source`: a measurement or the cost model). Packaged recipes are
found by model name (`flux-dev`); any other argument is read as a path. `streamfusion tune` writes into the
user's recipe folder (`user_folder()`), which method "auto" reads before the packaged recipes. An optional `calibration` mapping in
the file's header holds cost-model figures fitted from `streamfusion tune`'s measurements (choice/calibrate.py), one
set per GPU kind (`H200`, `H100`): the kinds differ in what the model cannot derive from bytes and FLOPs (launch and
transfer overheads, the attention rate reached), so each is fitted on its own measurements.

The files and their loader (here); `store` writes them, `choose` reads them for `method="auto"`, the `tune`
command measures the entries and `calibrate` fits the cost model to them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from ..core.config import ParallelConfig
from ..models.configs import FAMILIES

LAYOUT_KEYS = ("method", "ulysses", "ring", "torus", "backend")
SIZE_KEYS = ("resolution", "frames")
FOLDER_VARIABLE = "STREAMFUSION_RECIPES"


def user_folder() -> Path:
    """The user's recipes: $STREAMFUSION_RECIPES, else $XDG_CACHE_HOME/streamfusion/recipes (~/.cache/...)."""
    if os.environ.get(FOLDER_VARIABLE):
        return Path(os.environ[FOLDER_VARIABLE]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "streamfusion" / "recipes"


PACKAGED = resources.files(__package__) / "recipes"  # the packaged recipe files
ANY_GPU = "any"  # the kind of a calibration written before calibrations were kept per GPU kind


def gpu_kind(device: str) -> str:
    """The GPU model in a device name ('NVIDIA H100 80GB HBM3' -> 'H100'; 'h100' too), which a calibration is
    fitted for."""
    found = re.search(r"[A-Z]+\d+", device.upper().removeprefix("NVIDIA "))
    return found.group(0) if found else device


def calibration_for(calibrations: dict | None, gpu: str | None = None) -> dict | None:
    """The calibration of this GPU (a device name or kind); else the first one, that of the GPUs the recipe's
    entries were measured on (better than none for a GPU nobody fitted)."""
    if not calibrations:
        return None
    kind = gpu_kind(gpu) if gpu else None
    return calibrations[kind] if kind in calibrations else next(iter(calibrations.values()))


@dataclass(frozen=True)
class Recipe:
    model: str
    entries: tuple[dict, ...]
    path: str
    calibration: dict | None = None  # per GPU kind
    packaged: bool = False

    def calibration_for(self, gpu: str | None = None) -> dict | None:
        return calibration_for(self.calibration, gpu)

    def entry(self, machines: int, gpus_per_machine: int, link: str | None = None, **size: int) -> dict:
        """The entry for this cluster shape (and inter-machine link, when given) and size; the nearest size of
        the same shape when none is exact."""
        given = {k: v for k, v in size.items() if k in SIZE_KEYS and v is not None}
        same_shape = [e for e in self.entries
                      if (e["machines"], e["gpus_per_machine"]) == (machines, gpus_per_machine)
                      and (link is None or machines == 1 or e.get("link") == link)]
        if not same_shape:
            shapes = sorted({(e["machines"], e["gpus_per_machine"]) for e in self.entries})
            raise ValueError(f"recipe {self.path} has no entry for {machines} x {gpus_per_machine} GPUs; it covers "
                             f"{', '.join(f'{n} x {m}' for n, m in shapes)}: pick one of those or pass the layout "
                             f"(--method/--ulysses/--ring) yourself")
        return min(same_shape, key=lambda e: sum(abs(e.get(k, 0) - v) for k, v in given.items()))

    def config(self, machines: int, gpus_per_machine: int, link: str | None = None, **size: int) -> ParallelConfig:
        e = self.entry(machines, gpus_per_machine, link, **size)
        return ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine,
                              **{k: e[k] for k in LAYOUT_KEYS if e.get(k) is not None})


def packaged_names() -> list[str]:
    """The packaged recipes: those the model registry's families name (models/configs.py)."""
    return sorted(name for family in FAMILIES.values() for name in family.recipes)


def load_recipe(name_or_path: str) -> Recipe:
    """A packaged recipe by model name, or a YAML file by path."""
    packaged = PACKAGED / f"{name_or_path}.yaml"
    path = Path(name_or_path)
    if packaged.is_file():
        text, where = packaged.read_text(), f"{name_or_path} (packaged)"
    elif path.is_file():
        text, where = path.read_text(), str(path)
    else:
        raise ValueError(f"no recipe {name_or_path!r}: use one of {', '.join(packaged_names())} or a path to a "
                         f"YAML file")
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or "model" not in data or not data.get("entries"):
        raise ValueError(f"recipe {where} needs a 'model' and a non-empty 'entries' list")
    for e in data["entries"]:
        missing = [k for k in ("machines", "gpus_per_machine", "method") if k not in e]
        if missing:
            raise ValueError(f"recipe {where}: entry {e} lacks {', '.join(missing)}")
    calibration = data.get("calibration")
    if calibration and "attention_tflops" in calibration:  # one calibration for every GPU (older tune)
        calibration = {ANY_GPU: calibration}
    return Recipe(data["model"], tuple(data["entries"]), where, calibration, packaged.is_file())


def load_recipes(where: str | None = None) -> list[Recipe]:
    """Every recipe `method="auto"` may read: the user's folder's, then the packaged ones (None); one by name
    or path; or a folder's."""
    if where is None:
        mine = sorted(user_folder().glob("*.yaml"))
        return [load_recipe(str(p)) for p in mine] + [load_recipe(name) for name in packaged_names()]
    if Path(where).is_dir():
        found = sorted(Path(where).glob("*.yaml"))
        if not found:
            raise ValueError(f"recipe folder {where} holds no .yaml file; run `streamfusion tune --out {where}` first")
        return [load_recipe(str(p)) for p in found]
    return [load_recipe(where)]

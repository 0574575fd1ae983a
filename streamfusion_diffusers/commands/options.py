"""Command-line options: one meaning and one allowed range per option name across the commands, checked
before any process starts, each failure one line naming the option (no usage block, no traceback)."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

# option (argparse dest) -> (smallest, largest) allowed value, None: unbounded; the same in every command
RANGES: dict[str, tuple[float, float | None]] = {
    **dict.fromkeys(("machines", "gpus_per_machine", "nnodes", "nproc_per_node", "ulysses", "ring", "torus",
                     "height", "width", "resolution", "frames", "steps", "max_sequence_length", "heads", "head_dim",
                     "seq_len", "batch", "iters", "top", "replicas", "max_queue", "max_n", "max_steps", "max_pixels",
                     "max_frames", "max_prompt_chars", "max_body_bytes"), (1, None)),
    **dict.fromkeys(("joint", "warmup", "seed", "node_rank", "guidance_scale", "true_cfg_scale"), (0, None)),
    "gpu_memory": (1, None),  # GB
    "timeout": (1, None),
    "request_timeout": (0.001, None),
    "master_port": (1, 65535),
    "port": (0, 65535),
}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face hub names a repository


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the option and the fix (`--help` shows the usage)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric option within its range (RANGES): a given value is never replaced by a default."""
    for dest, (low, high) in RANGES.items():
        value = getattr(args, dest, None)
        if value is None or (low <= value and (high is None or value <= high)):
            continue
        allowed = f"at least {low:g}" if high is None else f"{low:g} .. {high:g}"
        raise ValueError(f"{option(dest)} {value:g}: must be {allowed}")


def check_weights(weights: str | None) -> None:
    """--weights: a local diffusers pipeline folder, or a hub id (owner/name) that is no local path."""
    if weights is None:
        return
    path = Path(weights).expanduser()
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ValueError(f"--weights {weights}: no model_index.json there; give a diffusers pipeline folder "
                             f"or a hub id such as black-forest-labs/FLUX.1-dev")
        return
    if weights.startswith(("/", ".", "~")) or not HUB_ID.fullmatch(weights):
        raise ValueError(f"--weights {weights}: no such folder, and not a hub id (owner/name such as "
                         f"black-forest-labs/FLUX.1-dev)")


def check_output(dest: str, folder: str | None) -> None:
    """An output folder that exists or can be created here."""
    if folder is None:
        return
    path = Path(folder).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option(dest)} {folder}: a file is in the way; name a folder")
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option(dest)} {folder}: cannot create it ({parent} is not writable)")


def check_recipe(recipe: str | None) -> None:
    """--recipe: a packaged recipe name, a YAML file or a folder of them (what method "auto" reads)."""
    if recipe is not None:
        from ..choice.recipe import load_recipes

        try:
            load_recipes(recipe)
        except ValueError as err:
            raise ValueError(f"--recipe {recipe}: {err}") from None


def check(args: argparse.Namespace) -> None:
    """All of the above, for whichever options this command has."""
    check_ranges(args)
    check_weights(getattr(args, "weights", None))
    for dest in ("output", "out"):
        check_output(dest, getattr(args, dest, None))
    check_recipe(getattr(args, "recipe", None))

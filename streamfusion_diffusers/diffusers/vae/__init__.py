"""The VAE decode over the job's ranks: one entry point, two strategies and a fallback.

`decode_over_ranks` makes a VAE's decode split over the ranks: patch-parallel bands where the VAE allows it
(`bands.py`: exact, about 1/P of the work per rank), else diffusers' tiles shared out (`tiles.py`), else
(VAEs of neither kind: Wan's, Qwen-Image's, Flux.2's) whole on every rank. `is_split` / `unsplit_vae_decode`
tell and undo either split.
"""
from __future__ import annotations

import logging

from torch import nn

from ...core.logs import say_once
from .bands import SUPPORTED, parallel_vae_decode, unsupported
from .tiles import is_split, split_vae_decode, unsplit_vae_decode

logger = logging.getLogger(__name__)


def decode_over_ranks(vae: nn.Module, rank: int, world: int) -> str:
    """The job's VAE decode over its ranks: patch-parallel where supported, else the tile split, else whole on
    every rank. Says which once and returns it: "patch-parallel", "tiles" or "whole"."""
    reason = unsupported(vae)
    if reason is None:
        parallel_vae_decode(vae, rank, world)
        return "patch-parallel"
    if not isinstance(vae, SUPPORTED):  # the tile split reads the tile grid of these two classes only
        say_once(logger, logging.INFO, "VAE decode: %s is decoded whole on every rank (no split for it)",
                 type(vae).__name__)
        return "whole"
    say_once(logger, logging.INFO, "VAE decode: patch-parallel not possible (%s); falling back to the tile split",
             reason)
    split_vae_decode(vae, rank, world)
    return "tiles"


__all__ = ["decode_over_ranks", "is_split", "unsplit_vae_decode"]

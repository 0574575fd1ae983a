"""The VAE decode over the job's ranks: one entry point, two strategies.

`decode_over_ranks` makes a VAE's decode split over the ranks: patch-parallel bands where the VAE allows it
(`vae_parallel.py`: exact, about 1/P of the work per rank), else diffusers' tiles shared out (`vae.py`).
`is_split` / `unsplit_vae_decode` tell and undo either.
"""
from __future__ import annotations

import logging

from torch import nn

from .logs import say_once
from .vae import is_split, split_vae_decode, unsplit_vae_decode
from .vae_parallel import parallel_vae_decode, unsupported

logger = logging.getLogger(__name__)


def decode_over_ranks(vae: nn.Module, rank: int, world: int) -> None:
    """The job's VAE decode over its ranks: patch-parallel where supported, else the tile split (said once)."""
    reason = unsupported(vae)
    if reason is None:
        parallel_vae_decode(vae, rank, world)
        return
    say_once(logger, logging.INFO, "VAE decode: patch-parallel not possible (%s); falling back to the tile split",
             reason)
    split_vae_decode(vae, rank, world)


__all__ = ["decode_over_ranks", "is_split", "unsplit_vae_decode"]

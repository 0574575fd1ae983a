"""The VAE decode over the job's ranks: one entry point, three strategies.

`decode_over_ranks` makes a VAE's decode split over the ranks: patch-parallel bands where every layer of its
decoder has a band rule (`bands.py`: exact, about 1/P of the work per rank; AutoencoderKL, Flux.2's, CogVideoX's,
Wan's, Qwen-Image's, LTX-2's and HunyuanVideo 1.5's VAEs), else diffusers' tiles shared out (`tiles.py`: the tiled
decode's output), else decoded on rank 0 alone and broadcast (`one_rank.py`). `is_split` / `unsplit_vae_decode`
tell and undo any.
"""
from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from ...core.logs import say_once
from .bands import parallel_vae_decode, unsupported
from .one_rank import one_rank_vae_decode
from .tiles import TILED, is_split, split_vae_decode, unsplit_vae_decode

logger = logging.getLogger(__name__)


def decode_over_ranks(vae: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> str:
    """The VAE decode shared out over `group` (None: the default group), of which this rank is `rank` of `world`:
    patch-parallel where supported, else the tile split, else on the group's first rank only. Says which once and
    returns it (run.json's `vae_decode`): "patch-parallel", "tiles" or "one-rank"; "whole" (every rank decodes,
    untouched) for a group of one rank or a VAE with no `_decode` to replace."""
    if world == 1:
        return "whole"
    if not hasattr(type(vae), "_decode"):  # e.g. AutoencoderTiny: no _decode below its decode to take over
        say_once(logger, logging.INFO, "VAE decode: %s is decoded whole on every rank", type(vae).__name__)
        return "whole"
    reason = unsupported(vae)
    if reason is None:
        parallel_vae_decode(vae, rank, world, group)
        return "patch-parallel"
    if not isinstance(vae, TILED):
        say_once(logger, logging.INFO, "VAE decode: neither bands nor tiles can split it (%s)", reason)
        one_rank_vae_decode(vae, world, group)
        return "one-rank"
    say_once(logger, logging.INFO, "VAE decode: patch-parallel not possible (%s); falling back to the tile split",
             reason)
    split_vae_decode(vae, rank, world, group)
    return "tiles"


__all__ = ["decode_over_ranks", "is_split", "unsplit_vae_decode"]

"""The VAE decode on one rank: the group's first rank decodes, the others wait for its result instead of decoding
it too.

The fallback for VAEs that neither the band split nor the tile split can take (e.g. LTX's, HunyuanVideo's):
every rank of a sequence-parallel job holds the same final latents and diffusers would have each decode all of
them, P times the work and the decoder's peak memory on every GPU. Here one rank runs diffusers' own `_decode`
and broadcasts the sample (its shape first), so every rank's pipeline still returns the same image or video.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.autoencoders.vae import DecoderOutput
from torch import Tensor, nn

from ...core.logs import say_once
from .tiles import is_split

logger = logging.getLogger(__name__)


def one_rank_decode(vae: nn.Module, z: Tensor, *args: Any, group: dist.ProcessGroup | None = None,
                    **kwargs: Any) -> Tensor:
    """Decode z on the first rank of `group` (None: the default group) and hand the sample to every rank of it
    (every rank of the group calls it with the same z). `args` / `kwargs` go to the class's `_decode` (LTX's temb,
    LTX-2's causal). The decoding rank and the broadcast's source are one global rank, read from the group."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    decoded = type(vae)._decode(vae, z, *args, **kwargs) if dist.get_rank() == source else None
    sample = None if decoded is None else (decoded if isinstance(decoded, Tensor) else decoded.sample).to(z.dtype)
    shape = torch.tensor(sample.shape if sample is not None else [0] * z.dim(), device=z.device)
    dist.broadcast(shape, source, group=group)
    if sample is None:
        sample = z.new_empty(shape.tolist())
    dist.broadcast(sample, source, group=group)
    return sample


def one_rank_vae_decode(vae: nn.Module, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Make `vae.decode` (and so the pipeline's decode) run on the first rank of `group` (None: the default
    group, `world` ranks) only, its result broadcast to the others.

    Replaces the instance's `_decode` as the other splits do (undo with `unsplit_vae_decode`), returning what the
    class's does (HunyuanVideo 1.5's returns the sample itself, no DecoderOutput).
    """
    if is_split(vae):
        raise ValueError("this VAE's decode is already split; call unsplit_vae_decode(vae) first")

    bare = "return_dict" not in inspect.signature(type(vae)._decode).parameters  # it returns the tensor itself

    def _decode(z: Tensor, *args: Any, return_dict: bool = True, **kwargs: Any) -> Tensor | DecoderOutput | tuple:
        sample = one_rank_decode(vae, z, *args, group=group, **kwargs)
        return sample if bare else DecoderOutput(sample=sample) if return_dict else (sample,)

    vae._decode = _decode
    say_once(logger, logging.INFO, "VAE decode: %s on one rank only, its result broadcast to the other %d ranks",
             type(vae).__name__, world - 1)


__all__ = ["one_rank_decode", "one_rank_vae_decode"]

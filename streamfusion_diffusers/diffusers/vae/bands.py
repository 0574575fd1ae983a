"""Exact patch-parallel VAE decode: each rank decodes one band of latent rows with diffusers' own decoder.

diffusers' tiles overlap (25% a side), so the tile split (`tiles.py`) does up to 2.25x the work of one untiled
decode and cannot beat it on 2 GPUs. Here (the idea of xDiT's distvae, our own code) the latent is cut along
the height into one contiguous band per rank, and while the decoder runs on a band every layer that looks
across rows is patched by the rule for its kind (`band_rules.py`: halo rows for convolutions, the temporal
cache of causal ones included; the whole image's GroupNorm moments; whole-image keys and values for spatial
attention), so the band behaves as part of the whole image. That covers AutoencoderKL (Flux.1), Flux.2's,
CogVideoX's, Wan 2.1 / 2.2's (3D causal, frame by frame; 2.2 patchified), Qwen-Image's, LTX-2's (reflection
padded, no attention, per-position norms) and HunyuanVideo 1.5's (replication padded, every frame at once, its
mid-block attention causal by frame) VAEs.

Nearest-neighbour and pixel-shuffle upsampling keep bands aligned by themselves. Decoded bands are gathered once
at the end, so the result is the untiled `vae.decode` on every rank, within float rounding, at about 1/P of its
work per rank.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from diffusers import (AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLFlux2, AutoencoderKLHunyuanVideo15,
                       AutoencoderKLLTX2Video, AutoencoderKLQwenImage, AutoencoderKLWan)
from diffusers.models.autoencoders.vae import DecoderOutput
from torch import Tensor, nn

from ...core.logs import say_once
from .band_rules import band_forward, band_layers, no_band_rule
from .band_split import Bands
from .tiles import is_split

logger = logging.getLogger(__name__)

# VAEs whose every decoder layer is known: per position, or of a kind band_rules covers
SUPPORTED = (AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLCogVideoX, AutoencoderKLWan, AutoencoderKLQwenImage,
             AutoencoderKLLTX2Video, AutoencoderKLHunyuanVideo15)


def unsupported(vae: Any) -> str | None:
    """Why this VAE cannot be decoded patch-parallel, or None when it can."""
    if not isinstance(vae, SUPPORTED):
        return f"{type(vae).__name__} is none of {', '.join(c.__name__ for c in SUPPORTED)}"
    return next(filter(None, (no_band_rule(name, m) for name, m in band_layers(vae.decoder))), None)


def _check(vae: Any) -> None:
    reason = unsupported(vae)
    if reason is not None:
        raise ValueError(f"the patch-parallel VAE decode cannot take this VAE: {reason}; use decode_over_ranks "
                         f"(streamfusion_diffusers.diffusers.vae), which falls back to the tile split or one rank")


@contextlib.contextmanager
def banded(decoder: nn.Module, bands: Bands) -> Iterator[None]:
    """Patch the decoder's layers that look across rows for band decoding; restore them on exit."""
    patched: list[tuple[nn.Module, Any]] = []  # with the instance forward it had (e.g. an offload hook's)
    try:
        for _, m in band_layers(decoder):
            forward = band_forward(m, bands)
            if forward is None:
                continue
            patched.append((m, m.__dict__.get("forward")))
            m.forward = forward
        yield
    finally:
        for m, before in patched:
            if before is None:
                del m.forward
            else:
                m.forward = before


def _class_decode(vae: nn.Module, z: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The sample of the class's own `_decode` (HunyuanVideo 1.5's returns it bare, the others in a DecoderOutput)."""
    decoded = type(vae)._decode(vae, z, *args, **kwargs)
    return decoded if isinstance(decoded, Tensor) else decoded.sample


def parallel_decode(vae: nn.Module, z: Tensor, rank: int, world: int, group: dist.ProcessGroup | None = None,
                    *args: Any, **kwargs: Any) -> Tensor:
    """Decode z over the `world` ranks of `group` (None: the default group), one band of latent rows each, this
    rank taking band `rank` (its place in the group); every rank of the group calls it with the same z. `args` /
    `kwargs` go to the class's `_decode` (LTX-2's temb and causal: per sample, not per row).

    Equals the untiled `type(vae)._decode(z)` (diffusers' tiling settings are ignored: a band needs no tiles).
    """
    _check(vae)
    bands = Bands.even(z.shape[-2], world, rank, group)
    top = sum(bands.rows[:rank])
    tiling, vae.use_tiling = vae.use_tiling, False
    try:
        with banded(vae.decoder, bands):
            band = _class_decode(vae, z[..., top:top + bands.rows[rank], :], *args, **kwargs)
    finally:
        vae.use_tiling = tiling
    return bands.gather_rows(band)


def parallel_vae_decode(vae: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> None:
    """Make `vae.decode` (and so the pipeline's decode) run patch-parallel over `group`'s ranks (None: the
    default group's), this rank being `rank` of `world` in it.

    Replaces the instance's `_decode` as the tile split does (undo with `vae.unsplit_vae_decode`).
    """
    _check(vae)
    if is_split(vae):
        raise ValueError("this VAE's decode is already split; call unsplit_vae_decode(vae) first")
    bare = "return_dict" not in inspect.signature(type(vae)._decode).parameters  # it returns the tensor itself

    def _decode(z: Tensor, *args: Any, return_dict: bool = True,
                **kwargs: Any) -> Tensor | DecoderOutput | tuple[Tensor]:
        if z.shape[-2] < world:  # fewer latent rows than ranks: each rank decodes all of them, as diffusers does
            say_once(logger, logging.INFO, "VAE decode: %d latent rows for %d ranks; every rank decodes them all",
                     z.shape[-2], world)
            sample = _class_decode(vae, z, *args, **kwargs)
        else:
            sample = parallel_decode(vae, z, rank, world, group, *args, **kwargs)
        return sample if bare else DecoderOutput(sample=sample) if return_dict else (sample,)

    vae._decode = _decode
    say_once(logger, logging.INFO, "VAE decode patch-parallel over %d ranks (one band of latent rows each)", world)


__all__ = ["banded", "parallel_decode", "parallel_vae_decode", "unsupported"]

"""Exact patch-parallel VAE decode: each rank decodes one band of latent rows with diffusers' own decoder.

diffusers' tiles overlap (25% a side), so the tile split (`tiles.py`) does up to 2.25x the work of one untiled
decode and cannot beat it on 2 GPUs. Here (the idea of xDiT's distvae, our own code) the latent is cut along
the height into one contiguous band per rank, and while the decoder runs on a band three kinds of layers are
patched so the band behaves as part of the whole image:

- every Conv2d / Conv3d wider than one row gets its halo rows from the neighbouring bands (one all-gather of
  boundary rows; the band-edge output rows are redone from thin strips) instead of zeros at band edges
  (CogVideoX's causal convolutions pad the height inside their Conv3d, so their temporal cache stays
  diffusers' own, per band);
- every GroupNorm normalizes with the global mean and variance, combined from per-rank moments (Chan's
  parallel formula: stable, one small all-gather);
- the spatial self-attention (AutoencoderKL's mid block) attends from its band's queries to keys and values
  of the whole image, gathered once.

Nearest-neighbour upsampling keeps bands aligned by itself. Decoded bands are gathered once at the end, so the
result is the untiled `vae.decode` on every rank, within float rounding, at about 1/P of its work per rank.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, AutoencoderKLCogVideoX
from diffusers.models.attention_processor import Attention
from diffusers.models.autoencoders.vae import DecoderOutput
from torch import Tensor, nn

from ..._moved import forward
from ...core.logs import say_once
from .tiles import is_split

logger = logging.getLogger(__name__)

SUPPORTED = (AutoencoderKL, AutoencoderKLCogVideoX)


@dataclass(frozen=True)
class Bands:
    """Latent rows of each rank's band (top to bottom), this rank, and the group the bands are spread over."""

    rows: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def even(cls, height: int, world: int, rank: int, group: dist.ProcessGroup | None = None) -> Bands:
        """Bands as even as the height allows (the first height % world bands one row taller)."""
        if height < world:
            raise ValueError(f"a latent {height} rows high cannot be cut into {world} bands; decode it on fewer "
                             f"ranks or with the tile split (streamfusion_diffusers.diffusers.vae.tiles.split_vae_decode)")
        return cls(tuple(height // world + (r < height % world) for r in range(world)), rank, group)

    def scaled(self, x: Tensor) -> list[int]:
        """Every band's rows at x's resolution (x is this rank's band, height at dim -2, upsampled k times)."""
        scale, rest = divmod(x.shape[-2], self.rows[self.rank])
        if rest:
            raise ValueError(f"a band of {x.shape[-2]} rows is no multiple of the latent band's "
                             f"{self.rows[self.rank]}: the decoder resizes by a non-integer factor")
        return [r * scale for r in self.rows]

    def all_gather(self, x: Tensor) -> list[Tensor]:
        out = [torch.empty_like(x) for _ in self.rows]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def gather_rows(self, x: Tensor) -> Tensor:
        """The whole image from every rank's band (dim -2), zero-padded to the tallest band for the all-gather."""
        rows = self.scaled(x)
        padded = F.pad(x, (0, 0, 0, max(rows) - x.shape[-2]))
        return torch.cat([part[..., :n, :] for part, n in zip(self.all_gather(padded), rows)], dim=-2)

    def neighbours(self, x: Tensor, pad: int) -> Callable[[], tuple[Tensor | None, Tensor | None]]:
        """Start fetching the `pad` rows just above and just below x's band; the returned call waits for them
        (None at the image's top / bottom edge). The fetch runs while the band's own convolution does."""
        if min(self.scaled(x)) < pad:
            raise ValueError(f"a band of {min(self.scaled(x))} rows cannot lend a {pad}-row halo; use fewer ranks")
        mine = torch.cat([x[..., :pad, :], x[..., -pad:, :]], dim=-2)
        edges = [torch.empty_like(mine) for _ in self.rows]
        work = dist.all_gather(edges, mine, group=self.group, async_op=True)

        def arrived() -> tuple[Tensor | None, Tensor | None]:
            work.wait()
            above = edges[self.rank - 1][..., pad:, :] if self.rank > 0 else None
            below = edges[self.rank + 1][..., :pad, :] if self.rank + 1 < len(self.rows) else None
            return above, below

        return arrived


def _conv_forward(conv: nn.Conv2d | nn.Conv3d, bands: Bands) -> Any:
    """The conv's own forward (CogVideoX's safe Conv3d chunking included), its band-edge rows redone with halos.

    The band is convolved as it is (zero padding at its edges: right at the image's edges) while the halos
    travel, then the `pad` rows at an inner edge are recomputed from a thin strip (halo + 2 * pad rows of the
    band) convolved without height padding. That spares a haloed copy of the whole band per convolution.
    """
    forward, padding = conv.forward, conv.padding
    pad = padding[-2]

    def unpadded(x: Tensor) -> Tensor:
        conv.padding = (*padding[:-2], 0, padding[-1])
        try:
            return forward(x)
        finally:
            conv.padding = padding

    def halo_forward(x: Tensor) -> Tensor:
        arrived = bands.neighbours(x, pad)
        if x.shape[-2] < 2 * pad:  # too thin for strips: the whole band with its halos
            above, below = arrived()
            zeros = torch.zeros_like(x[..., :pad, :])
            return unpadded(torch.cat([zeros if above is None else above, x, zeros if below is None else below],
                                      dim=-2))
        out = forward(x)
        above, below = arrived()
        if above is not None:
            out[..., :pad, :] = unpadded(torch.cat([above, x[..., :2 * pad, :]], dim=-2))
        if below is not None:
            out[..., -pad:, :] = unpadded(torch.cat([x[..., -2 * pad:, :], below], dim=-2))
        return out

    return halo_forward


def _local_moments(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and variance over the last dim, in float32. A float32 band gets torch's stable var_mean; a bf16 /
    fp16 one (memory-bound at the decoder's top resolution) gets float32 sums of x and x^2 (each one pass that
    casts while it reads, on CUDA) instead of a float32 copy of the band and two more passes over it."""
    if x.dtype in (torch.float32, torch.float64):
        var, mean = torch.var_mean(x, dim=-1, correction=0)
        return mean.float(), var.float()
    mean = x.sum(-1, dtype=torch.float32) / x.shape[-1]
    squares = torch.linalg.vector_norm(x, 2, dim=-1, dtype=torch.float32) ** 2 / x.shape[-1]
    return mean, (squares - mean**2).clamp_(min=0)


def _global_moments(x: Tensor, groups: int, bands: Bands) -> tuple[Tensor, Tensor]:
    """Mean and variance per (sample, group) over every band: moments per band, combined in float64 by Chan's
    parallel formula."""
    mean, var = _local_moments(x.reshape(x.shape[0], groups, -1))
    count = torch.full_like(mean, x[0].numel() // groups, dtype=torch.float64)
    moments = torch.stack([count, mean.double(), var.double() * count])
    counts, means, m2s = torch.stack(bands.all_gather(moments)).unbind(1)  # each [world, samples, groups]
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    return mean, (m2s + counts * (means - mean) ** 2).sum(0) / total


def _group_norm_forward(norm: nn.GroupNorm, bands: Bands) -> Any:
    """GroupNorm with the whole image's statistics, applied (with the affine) by batch_norm in one kernel."""

    def global_forward(x: Tensor) -> Tensor:
        n, c = x.shape[:2]
        per_group = c // norm.num_groups
        stats = [s.float().repeat_interleave(per_group, dim=1).flatten()
                 for s in _global_moments(x, norm.num_groups, bands)]
        affine = [None if p is None else p.float().repeat(n) for p in (norm.weight, norm.bias)]
        out = F.batch_norm(x.reshape(1, n * c, -1), *stats, *affine, training=False, eps=norm.eps)
        return out.reshape(x.shape)

    return global_forward


def _attention_forward(attn: Attention, bands: Bands) -> Any:
    """Self-attention from the band's queries to the whole image's keys and values.

    The processor normalizes and projects its own band (the GroupNorm is patched to global statistics); the
    whole image goes in as `encoder_hidden_states`, normalized here by the unpatched GroupNorm on all of it.
    """
    forward = attn.forward

    def gathered_forward(hidden_states: Tensor, encoder_hidden_states: Tensor | None = None, **kwargs: Any) -> Tensor:
        if hidden_states.ndim != 4 or encoder_hidden_states is not None or attn.spatial_norm is not None:
            raise ValueError("the patch-parallel VAE decode supports spatial self-attention only; "
                             "use the tile split (streamfusion_diffusers.diffusers.vae.tiles.split_vae_decode)")
        whole = bands.gather_rows(hidden_states).flatten(2)
        if attn.group_norm is not None:
            whole = nn.GroupNorm.forward(attn.group_norm, whole)
        return forward(hidden_states, encoder_hidden_states=whole.transpose(1, 2), **kwargs)

    return gathered_forward


def unsupported(vae: Any) -> str | None:
    """Why this VAE cannot be decoded patch-parallel, or None when it can."""
    if not isinstance(vae, SUPPORTED):
        return f"{type(vae).__name__} is not AutoencoderKL or AutoencoderKLCogVideoX"
    for name, m in vae.decoder.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.kernel_size[-2] > 1 and (
                isinstance(m.padding, str) or m.padding_mode != "zeros" or m.stride[-2] != 1
                or m.dilation[-2] != 1 or 2 * m.padding[-2] + 1 != m.kernel_size[-2]):
            return f"its convolution {name} is not a stride-1, zero-padded, centred one"
        if isinstance(m, nn.ConvTranspose2d) or (isinstance(m, Attention) and m.is_cross_attention):
            return f"its layer {name} ({type(m).__name__}) has no band rule"
    return None


def _check(vae: Any) -> None:
    reason = unsupported(vae)
    if reason is not None:
        raise ValueError(f"the patch-parallel VAE decode cannot take this VAE: {reason}; "
                         f"use the tile split (streamfusion_diffusers.diffusers.vae.tiles.split_vae_decode)")


@contextlib.contextmanager
def banded(decoder: nn.Module, bands: Bands) -> Iterator[None]:
    """Patch the decoder's convolutions, GroupNorms and attentions for band decoding; restore them on exit."""
    patched: list[tuple[nn.Module, Any]] = []  # with the instance forward it had (e.g. an offload hook's)
    try:
        for m in decoder.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.kernel_size[-2] > 1:
                forward = _conv_forward(m, bands)
            elif isinstance(m, nn.GroupNorm):
                forward = _group_norm_forward(m, bands)
            elif isinstance(m, Attention):
                forward = _attention_forward(m, bands)
            else:
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


def parallel_decode(vae: nn.Module, z: Tensor, rank: int, world: int,
                    group: dist.ProcessGroup | None = None) -> Tensor:
    """Decode z over `world` ranks, one band of latent rows each (every rank calls it with the same z).

    Equals the untiled `type(vae)._decode(z)` (diffusers' tiling settings are ignored: a band needs no tiles).
    """
    _check(vae)
    bands = Bands.even(z.shape[-2], world, rank, group)
    top = sum(bands.rows[:rank])
    tiling, vae.use_tiling = vae.use_tiling, False
    try:
        with banded(vae.decoder, bands):
            band = type(vae)._decode(vae, z[..., top:top + bands.rows[rank], :]).sample
    finally:
        vae.use_tiling = tiling
    return bands.gather_rows(band)


def parallel_vae_decode(vae: nn.Module, rank: int, world: int) -> None:
    """Make `vae.decode` (and so the pipeline's decode) run patch-parallel over the default group's ranks.

    Replaces the instance's `_decode` as the tile split does (undo with `vae.unsplit_vae_decode`).
    """
    _check(vae)
    if is_split(vae):
        raise ValueError("this VAE's decode is already split; call unsplit_vae_decode(vae) first")

    def _decode(z: Tensor, return_dict: bool = True) -> DecoderOutput | tuple[Tensor]:
        if z.shape[-2] < world:  # fewer latent rows than ranks: each rank decodes all of them, as diffusers does
            say_once(logger, logging.INFO, "VAE decode: %d latent rows for %d ranks; every rank decodes them all",
                     z.shape[-2], world)
            sample = type(vae)._decode(vae, z).sample
        else:
            sample = parallel_decode(vae, z, rank, world)
        return DecoderOutput(sample=sample) if return_dict else (sample,)

    vae._decode = _decode
    say_once(logger, logging.INFO, "VAE decode patch-parallel over %d ranks (one band of latent rows each)", world)


__all__ = ["Bands", "banded", "parallel_decode", "parallel_vae_decode", "unsupported"]

__getattr__ = forward(__name__, "streamfusion_diffusers.diffusers.vae")  # decode_over_ranks, until the next release

"""The band rules of the patch-parallel VAE decode, one per kind of layer that mixes rows of the image.

A decoder run on one band of latent rows behaves as part of the whole image when every layer that looks across
rows sees what it would see in the whole image; layers that work per position (activations, RMS norms over the
channels as Wan's and Qwen-Image's, 1x1 convolutions, nearest and pixel-shuffle upsampling) need nothing. The
kinds, recognized by structure rather than by model:

- a convolution wider than one row (Conv2d, Conv3d; CogVideoX's pads the height inside its Conv3d; Wan's and
  Qwen-Image's causal Conv3d pads inside its forward from `_padding` and is handed the last frames before this
  one as a temporal cache; LTX-2's pads by reflection; HunyuanVideo 1.5's wraps an unpadded Conv3d and pads
  around it by replication) gets its halo rows from the neighbouring bands, of the cache frames too, and pads as
  it does only at the image's top and bottom edges;
- a GroupNorm normalizes with the whole image's moments;
- a spatial self-attention attends from its band's queries to the whole image's keys and values: diffusers'
  `Attention` (AutoencoderKL's and Flux.2's mid block), the per-frame single-head block of Wan and Qwen-Image and
  HunyuanVideo 1.5's single-head block over every frame, causal by frame.

`band_layers` lists the layers the rules look at, `band_forward` gives a layer's band forward, `no_band_rule`
names a layer that would be wrong on a band.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (HunyuanVideo15AttnBlock,
                                                                          HunyuanVideo15CausalConv3d)
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageAttentionBlock
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock
from torch import Tensor, nn

from .band_split import Bands, stacked

FRAME_ATTENTION = (WanAttentionBlock, QwenImageAttentionBlock)  # the same block: norm, to_qkv, one head, proj
# padding modes whose rows at the image's edge come from the image itself (the edge band holds them): not circular
EDGE_PADDING = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate"}


def _pads_in_forward(conv: nn.Module) -> bool:
    """A causal Conv3d of Wan's kind: zero `padding`, its (w, w, h, h, t, 0) padding applied by F.pad in forward."""
    return isinstance(conv, nn.Conv3d) and len(getattr(conv, "_padding", ())) == 6 and not any(conv.padding)


def _pads_around(m: nn.Module) -> bool:
    """HunyuanVideo 1.5's wrapper: an unpadded Conv3d `conv` inside, its (w, w, h, h, t, 0) padding applied around
    it by F.pad in `pad_mode` from `time_causal_padding` (by class: CogVideoX's wrapper has those attributes too,
    but pads inside its conv and returns a cache beside the output)."""
    return isinstance(m, HunyuanVideo15CausalConv3d)


def _rows_conv(m: nn.Module) -> nn.Conv2d | nn.Conv3d | None:
    """The convolution by which a layer looks across rows (its own, or a padding wrapper's inner one), or None."""
    conv = m.conv if _pads_around(m) else m
    return conv if isinstance(conv, (nn.Conv2d, nn.Conv3d)) and conv.kernel_size[-2] > 1 else None


def _padding_attr(conv: nn.Module) -> str:
    """Where the height padding is read: HunyuanVideo 1.5's wrapper pads from `time_causal_padding`, Wan's forward
    from `_padding`, a reflect-padded conv from the F.pad amounts torch keeps (all three (w, w, h, h, ...)), a
    zero-padded one from `padding`."""
    if _pads_around(conv):
        return "time_causal_padding"
    if _pads_in_forward(conv):
        return "_padding"
    return "padding" if conv.padding_mode == "zeros" else "_reversed_padding_repeated_twice"


def _height_pad(conv: nn.Module) -> int:
    attr = _padding_attr(conv)
    return conv.padding[-2] if attr == "padding" else getattr(conv, attr)[2]


def _edge_mode(conv: nn.Module) -> str:
    """The F.pad mode of the conv's height padding at the image's edge."""
    return conv.pad_mode if _pads_around(conv) else EDGE_PADDING[conv.padding_mode]


def _conv_forward(conv: nn.Module, bands: Bands) -> Callable[..., Tensor]:
    """The conv's own forward (CogVideoX's safe Conv3d chunking, Wan's causal padding and cache, HunyuanVideo
    1.5's padding wrapper included), its band-edge rows redone with halos.

    The band is convolved as it is (padded at its edges: right at the image's edges) while the halos travel, then
    the `pad` rows at an inner edge are recomputed from a thin strip (halo + 2 * pad rows of the band) convolved
    without height padding. That spares a haloed copy of the whole band per convolution. A temporal cache (the
    frames before x) travels with x, stacked before it in time, and is cut to the strip too.
    """
    forward, pad, attr = conv.forward, _height_pad(conv), _padding_attr(conv)

    def unpadded(x: Tensor, *cache: Tensor) -> Tensor:
        padding = getattr(conv, attr)
        setattr(conv, attr, (*padding[:-2], 0, padding[-1]) if attr == "padding" else (*padding[:2], 0, 0,
                                                                                        *padding[4:]))
        try:
            return forward(x, *cache)
        finally:
            setattr(conv, attr, padding)

    def halo_forward(x: Tensor, cache: Tensor | None = None) -> Tensor:
        cache = None if cache is None else cache.to(x.device)
        frames = 0 if cache is None else cache.shape[2]

        def convolved(rows: Tensor) -> Tensor:  # rows stacked as `stacked` stacks them, halos included
            return unpadded(rows) if cache is None else unpadded(rows[:, :, frames:], rows[:, :, :frames])

        arrived = bands.neighbours(x, pad, cache)
        if x.shape[-2] < 2 * pad:  # too thin for strips: the whole band with its halos, padded at the image's edge
            above, below = arrived()
            rows = torch.cat([part for part in (above, stacked(x, cache, slice(None)), below) if part is not None],
                             dim=-2)
            edges = (0, 0, pad if above is None else 0, pad if below is None else 0) + (0, 0) * (rows.dim() - 4)
            return convolved(F.pad(rows, edges, mode=_edge_mode(conv)))
        out = forward(x) if cache is None else forward(x, cache)
        above, below = arrived()
        if above is not None:
            out[..., :pad, :] = convolved(torch.cat([above, stacked(x, cache, slice(None, 2 * pad))], dim=-2))
        if below is not None:
            out[..., -pad:, :] = convolved(torch.cat([stacked(x, cache, slice(-2 * pad, None)), below], dim=-2))
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


def _group_norm_forward(norm: nn.GroupNorm, bands: Bands) -> Callable[[Tensor], Tensor]:
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


def _attention_forward(attn: Attention, bands: Bands) -> Callable[..., Tensor]:
    """diffusers' Attention from the band's queries to the whole image's keys and values.

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


def _frame_attention_forward(block: nn.Module, bands: Bands) -> Callable[[Tensor], Tensor]:
    """Wan's / Qwen-Image's block (per frame, one head, RMS norm per position) from the band's queries to the
    whole frame's keys and values: the band's q, k, v by the block's own layers, then k and v gathered once."""

    def gathered_forward(x: Tensor) -> Tensor:
        b, c, t, h, w = x.shape
        qkv = block.to_qkv(block.norm(x.transpose(1, 2).reshape(b * t, c, h, w)))
        q, kv = qkv[:, :c], bands.gather_rows(qkv[:, c:])
        q, k, v = (y.flatten(2).transpose(1, 2).unsqueeze(1) for y in (q, *kv.chunk(2, dim=1)))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        return block.proj(out).view(b, t, c, h, w).transpose(1, 2) + x

    return gathered_forward


def _causal_attention_forward(block: HunyuanVideo15AttnBlock, bands: Bands) -> Callable[[Tensor], Tensor]:
    """HunyuanVideo 1.5's block (one head over every frame, each frame's queries seeing its own frame and the ones
    before it, RMS norm per position) from the band's queries to the whole video's keys and values: the band's q,
    k, v by the block's own layers, then k and v gathered once."""

    def tokens(y: Tensor) -> Tensor:  # (b, c, t, h, w) -> (b, 1, t * h * w, c), frame by frame
        return y.flatten(2).transpose(1, 2).unsqueeze(1)

    def frames(y: Tensor) -> Tensor:  # each token's frame, in `tokens`' order
        return torch.arange(y.shape[2], device=y.device).repeat_interleave(y.shape[-2] * y.shape[-1])

    def gathered_forward(x: Tensor) -> Tensor:
        normed = block.norm(x)
        q = block.to_q(normed)
        k, v = bands.gather_rows(torch.cat([block.to_k(normed), block.to_v(normed)], dim=1)).chunk(2, dim=1)
        causal = frames(q)[:, None] >= frames(k)[None, :]
        out = F.scaled_dot_product_attention(tokens(q), tokens(k), tokens(v), attn_mask=causal)
        return block.proj_out(out.squeeze(1).transpose(1, 2).reshape(q.shape)) + x

    return gathered_forward


def band_forward(m: nn.Module, bands: Bands) -> Callable[..., Tensor] | None:
    """The band forward for a layer of a kind that looks across rows, or None for one that works per row."""
    if _rows_conv(m) is not None:
        return _conv_forward(m, bands)
    if isinstance(m, nn.GroupNorm):
        return _group_norm_forward(m, bands)
    if isinstance(m, Attention):
        return _attention_forward(m, bands)
    if isinstance(m, FRAME_ATTENTION):
        return _frame_attention_forward(m, bands)
    if isinstance(m, HunyuanVideo15AttnBlock):
        return _causal_attention_forward(m, bands)
    return None


def band_layers(decoder: nn.Module) -> list[tuple[str, nn.Module]]:
    """The decoder's layers (by name) that the rules look at: all but the convolutions a padding wrapper runs, whose
    rows its own rule pads."""
    layers = list(decoder.named_modules())
    wrapped = {id(m.conv) for _, m in layers if _pads_around(m)}
    return [(name, m) for name, m in layers if id(m) not in wrapped]


def no_band_rule(name: str, m: nn.Module) -> str | None:
    """Why this layer would be wrong on a band (an edge no halo rule covers), or None when a rule covers it."""
    conv = _rows_conv(m)
    if conv is not None:
        # a wrapper pads around its unpadded conv by F.pad; a conv pads by its own padding mode
        padded = m.padding_mode in EDGE_PADDING if conv is m else (not any(conv.padding)
                                                                   and m.pad_mode in EDGE_PADDING.values())
        if (isinstance(conv.padding, str) or not padded or conv.stride[-2] != 1 or conv.dilation[-2] != 1
                or 2 * _height_pad(m) + 1 != conv.kernel_size[-2]):
            return f"its convolution {name} is not a stride-1, centred one padded by zeros, reflection or replication"
    if isinstance(m, nn.ConvTranspose2d) or (isinstance(m, Attention) and m.is_cross_attention):
        return f"its layer {name} ({type(m).__name__}) has no band rule"
    return None


__all__ = ["FRAME_ATTENTION", "band_forward", "band_layers", "no_band_rule"]

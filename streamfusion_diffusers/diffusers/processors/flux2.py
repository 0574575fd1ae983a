"""Flux.2's attention processors with RoPE in one pass: diffusers' calls step for step, the attention run as
Flux.1's (processors/flux.py `rotary_attention`: the rotary embedding by kernels/rotary.py, one Triton pass on
GPUs with diffusers' numbers bit for bit, where diffusers' `apply_rotary_emb` makes about eight per tensor at every
block). `parallelize` installs them in place of the stock processors, on the "streamfusion" backend (routing.py).
"""
from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux2 import (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor,
                                                             _get_qkv_projections)
from torch import Tensor

from .flux import rotary_attention


class Flux2RotaryAttnProcessor(Flux2AttnProcessor):
    """diffusers' Flux2AttnProcessor (the joint blocks) with RoPE in one pass."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        projections = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        out = rotary_attention(self, attn, projections, attention_mask, image_rotary_emb)
        text = None
        if encoder_hidden_states is not None:
            joint = encoder_hidden_states.shape[1]
            text, out = out.split_with_sizes([joint, out.shape[1] - joint], dim=1)
            text = attn.to_add_out(text)
        out = attn.to_out[1](attn.to_out[0](out))
        return out if text is None else (out, text)


class Flux2RotaryParallelSelfAttnProcessor(Flux2ParallelSelfAttnProcessor):
    """diffusers' Flux2ParallelSelfAttnProcessor (the single blocks: Q/K/V and the MLP's input in one projection)
    with RoPE in one pass."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, attention_mask: Tensor | None = None,
                 image_rotary_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        # the Q/K/V and MLP halves by their global ratio: the same split when the projection is column-sharded
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        out = rotary_attention(self, attn, (*qkv.chunk(3, dim=-1), None, None, None), attention_mask,
                               image_rotary_emb)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


__all__ = ["Flux2RotaryAttnProcessor", "Flux2RotaryParallelSelfAttnProcessor"]

"""Flux.2's attention processors with RoPE in one pass: diffusers' calls step for step, the rotary embedding of
Q and K done by kernels/rotary.py (one Triton pass on GPUs, diffusers' numbers bit for bit) where diffusers'
`apply_rotary_emb` makes about eight per tensor at every block. `parallelize` installs them in place of the stock
processors, routed to the "streamfusion" backend like the stock ones (routing.py).
"""
from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux2 import (Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor,
                                                             _get_qkv_projections)
from torch import Tensor

from ...kernels.rotary import rotary_qk


class Flux2RotaryAttnProcessor(Flux2AttnProcessor):
    """diffusers' Flux2AttnProcessor (the joint blocks) with RoPE in one pass."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        heads = (-1, attn.head_dim)  # -1: the heads this rank holds (its share under tensor parallelism)
        q, k, v = attn.norm_q(q.unflatten(-1, heads)), attn.norm_k(k.unflatten(-1, heads)), v.unflatten(-1, heads)
        if attn.added_kv_proj_dim is not None:
            eq, ek = attn.norm_added_q(eq.unflatten(-1, heads)), attn.norm_added_k(ek.unflatten(-1, heads))
            q, k = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1)
            v = torch.cat([ev.unflatten(-1, heads), v], dim=1)
        if image_rotary_emb is not None:
            q, k = rotary_qk(q, k, image_rotary_emb)
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config).flatten(2, 3).to(q.dtype)
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
        q, k, v = qkv.chunk(3, dim=-1)
        heads = (-1, attn.head_dim)
        q, k, v = attn.norm_q(q.unflatten(-1, heads)), attn.norm_k(k.unflatten(-1, heads)), v.unflatten(-1, heads)
        if image_rotary_emb is not None:
            q, k = rotary_qk(q, k, image_rotary_emb)
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config).flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


__all__ = ["Flux2RotaryAttnProcessor", "Flux2RotaryParallelSelfAttnProcessor"]

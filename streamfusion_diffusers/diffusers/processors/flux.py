"""Flux.1's attention processors: diffusers' FluxAttnProcessor call with RoPE in one pass, and the
sequence-parallel processor for `set_attn_processor` users built on it.

`FluxRotaryAttnProcessor` makes diffusers' call step for step, the rotary embedding of Q and K done by
kernels/rotary.py (one Triton pass on GPUs, diffusers' numbers bit for bit) where diffusers' `apply_rotary_emb`
makes about eight per tensor at every block. `parallelize` installs it in place of the stock processor
(routing.py); `FluxSPAttnProcessor` is the same call on the "streamfusion" backend for
those who set processors themselves.
"""
from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections
from torch import Tensor

from ...context import ParallelContext
from ...kernels.rotary import rotary_qk
from .backend import Route, backend_name
from .base import ShardState, SPAttnProcessor


def rotary_qkv(attn: torch.nn.Module, projections: tuple[Tensor | None, ...],
               image_rotary_emb: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """Flux.1's and Flux.2's q, k, v [B, S, H, D] from their projections (q, k, v and the text's, None without
    text), as diffusers' processors make them: heads split, QK-norm, the text's rows first, RoPE (here in one
    pass)."""
    q, k, v, eq, ek, ev = projections
    heads = (-1, attn.head_dim)  # -1: the heads this rank holds (its share under tensor parallelism)
    q, k, v = attn.norm_q(q.unflatten(-1, heads)), attn.norm_k(k.unflatten(-1, heads)), v.unflatten(-1, heads)
    if eq is not None:  # no comprehensions on this path: it runs at every block, eagerly too
        eq, ek = attn.norm_added_q(eq.unflatten(-1, heads)), attn.norm_added_k(ek.unflatten(-1, heads))
        q, k = torch.cat([eq, q], dim=1), torch.cat([ek, k], dim=1)
        v = torch.cat([ev.unflatten(-1, heads), v], dim=1)
    if image_rotary_emb is not None:
        q, k = rotary_qk(q, k, image_rotary_emb)
    return q, k, v


def rotary_attention(processor: FluxAttnProcessor, attn: torch.nn.Module, projections: tuple[Tensor | None, ...],
                     attention_mask: Tensor | None, image_rotary_emb: tuple[Tensor, Tensor] | None) -> Tensor:
    """Flux.1's and Flux.2's attention from their projections, as diffusers' processors run it: `rotary_qkv`,
    then `dispatch_attention_fn` on the processor's backend; [B, S, H * D] in Q's dtype."""
    q, k, v = rotary_qkv(attn, projections, image_rotary_emb)
    return dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=processor._attention_backend,
                                 parallel_config=processor._parallel_config).flatten(2, 3).to(q.dtype)


class FluxRotaryAttnProcessor(FluxAttnProcessor):
    """diffusers' FluxAttnProcessor (joint and single blocks) with RoPE in one pass."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        projections = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        out = rotary_attention(self, attn, projections, attention_mask, image_rotary_emb)
        return flux_output(attn, out, encoder_hidden_states)


def flux_output(attn: torch.nn.Module, out: Tensor, encoder_hidden_states: Tensor | None
                ) -> Tensor | tuple[Tensor, Tensor]:
    """What diffusers' Flux.1 processor returns from its attention's output [B, S, H * D]: a single block's rows
    as they are; a joint block's image and text rows, each through its output projection."""
    if encoder_hidden_states is None:
        return out
    joint = encoder_hidden_states.shape[1]
    text, out = out.split_with_sizes([joint, out.shape[1] - joint], dim=1)
    return attn.to_out[1](attn.to_out[0](out.contiguous())), attn.to_add_out(text.contiguous())


class FluxSPAttnProcessor(SPAttnProcessor, FluxRotaryAttnProcessor):
    """FluxRotaryAttnProcessor with its attention run by `sp_attention`. Joint blocks get text (`encoder_hidden_states`) and image tokens and return both; single blocks get the
    already-concatenated [text ; image] tokens and return one tensor: the stock call and return. `state` tells
    which leading tokens are replicated text (None: equal slices, no joint tokens)."""

    def __init__(self, ctx: ParallelContext, state: ShardState | None = None):
        FluxAttnProcessor.__init__(self)
        SPAttnProcessor.__init__(self, ctx, state)
        self._attention_backend = backend_name()
        self._parallel_config = Route(self.ctx, self.state, type(self).__name__)


__all__ = ["FluxRotaryAttnProcessor", "FluxSPAttnProcessor", "flux_output", "rotary_attention", "rotary_qkv"]

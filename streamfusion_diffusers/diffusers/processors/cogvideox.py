"""Sequence-parallel processor for CogVideoX's attention: [text ; video] tokens, RoPE on the video part only."""
from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb

from .base import SPAttnProcessor, attend, reject_mask


class CogVideoXSPAttnProcessor(SPAttnProcessor):
    """diffusers' CogVideoXAttnProcessor2_0 (and its fused-QKV twin) with the attention run by `sp_attention`.

    Same call signature and return value as the stock processor: (video tokens, text tokens). Tensors stay
    [B, L, H, D] throughout, the layout `sp_attention` takes; LayerNorm QK-norm and RoPE act per token and
    per head, so the layout does not change their math.
    """

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reject_mask(attention_mask)
        query, key, value = self.project(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        return self.output(attn, attend(query, key, value, self.ctx, self.state), encoder_hidden_states.size(1))

    @staticmethod
    def project(attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as [B, L, H, D], text rows first: everything before attention, per token
        (RoPE covers the video rows it is given)."""
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        batch_size = hidden_states.shape[0]

        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query[:, text_seq_length:] = apply_rotary_emb(query[:, text_seq_length:], image_rotary_emb, sequence_dim=1)
            if not attn.is_cross_attention:
                key[:, text_seq_length:] = apply_rotary_emb(key[:, text_seq_length:], image_rotary_emb, sequence_dim=1)
        return query, key, value

    @staticmethod
    def output(attn: Attention, hidden_states: torch.Tensor, text_seq_length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output [B, L, H, D] (text rows first) through the output projection: (video, text)."""
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states

"""Sequence-parallel processor for diffusers' FluxAttention (the joint blocks and the single blocks)."""
from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, _get_qkv_projections

from .base import SPAttnProcessor, reject_mask


class FluxSPAttnProcessor(SPAttnProcessor):
    """diffusers' FluxAttnProcessor step for step, with the attention itself run by `sp_attention`.

    Joint blocks get text (`encoder_hidden_states`) and image tokens and return both; single blocks get the
    already-concatenated [text ; image] tokens and return one tensor. The call signature is the stock one, so
    FluxAttention passes the same arguments. `state` tells which leading tokens are replicated text.
    """

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        reject_mask(attention_mask)
        query, key, value = self.project(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        hidden_states = self.attend(query, key, value).to(query.dtype)
        text_len = None if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        return self.output(attn, hidden_states, text_len)

    @staticmethod
    def project(attn: FluxAttention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V as [B, L, H, D], text rows first: everything before attention, per token (waves.py runs it
        for one wave of tokens at a time)."""
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if encoder_query is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        return query, key, value

    @staticmethod
    def output(attn: FluxAttention, hidden_states: torch.Tensor, text_len: int | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The attention output [B, L, H, D] (text rows first) through the output projections."""
        hidden_states = hidden_states.flatten(2, 3)
        if text_len is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states

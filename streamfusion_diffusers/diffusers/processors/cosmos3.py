"""Sequence-parallel processor for Cosmos3's dual-pathway attention: the text whole, the generation tokens split."""
from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3PackedMoTAttention, _rotate_half

from .base import SPAttnProcessor, attend

Rotary = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Cosmos3SPAttnProcessor(SPAttnProcessor):
    """diffusers' Cosmos3AttnProcessor with its generation pathway run by `sp_attention`.

    Same call signature and return value as the stock processor: (understanding, generation) outputs. The
    understanding (text) tokens are whole on every rank and attend only each other, causally: that pathway runs
    locally, as the stock one does. The split generation queries attend [text ; generation] keys: the split
    attention with the text as joint rows. `sp_attention` takes joint keys with their queries, so the text's own
    queries ride along and their output is dropped (the causal pathway gave theirs). K and V are repeated to the
    query heads first (GQA's grouping, as SDPA's enable_gqa): the heads all-to-all takes one head count for all.
    """

    def __call__(self, attn: Cosmos3PackedMoTAttention, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        q_und, k_und, v_und, k_und_for_gen, q_gen, k_gen, v_gen = self.project(attn, und_seq, gen_seq, rotary_emb)
        causal_out = dispatch_attention_fn(q_und[None], k_und[None], v_und[None], is_causal=True, enable_gqa=True)
        groups = attn.num_key_value_groups
        query = torch.cat([q_und, q_gen])[None]
        key = torch.cat([k_und_for_gen, k_gen]).repeat_interleave(groups, dim=1)[None]
        value = torch.cat([v_und, v_gen]).repeat_interleave(groups, dim=1)[None]
        full_out = attend(query, key, value, self.ctx, self.state)[0, len(und_seq):]
        return attn.to_out(causal_out[0].flatten(-2, -1)), attn.to_add_out(full_out.flatten(-2, -1))

    @staticmethod
    def project(attn: Cosmos3PackedMoTAttention, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: Rotary
                ) -> tuple[torch.Tensor, ...]:
        """Q, K, V of both pathways as [L, heads, D], normed and rotated, and the text keys the generation
        pathway attends: the stock processor's steps before its attention, per token."""
        heads, kv_heads, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, heads, d))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv_heads, d))
        v_und = attn.to_v(und_seq).view(-1, kv_heads, d)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, heads, d))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv_heads, d))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv_heads, d)
        cos_und, sin_und, cos_gen, sin_gen = (x.unsqueeze(1) for x in rotary_emb)

        def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return x * cos + _rotate_half(x) * sin

        return (rotate(q_und, cos_und, sin_und), rotate(k_und, cos_und, sin_und), v_und,
                rotate(k_und_for_gen, cos_und, sin_und), rotate(q_gen, cos_gen, sin_gen),
                rotate(k_gen, cos_gen, sin_gen), v_gen)

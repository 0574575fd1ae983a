"""Flux.1's single blocks with the Ulysses all-to-alls hidden behind their MLP projections.

A single block projects its normed tokens twice, independently: to Q, K, V for attention, and through proj_mlp
for its MLP; proj_out then maps [attention ; MLP] back. Under Ulysses, Q/K/V and the attention's output cross
the SP group by all-to-all, and the stock block runs proj_mlp before the attention and all of proj_out after it,
so both exchanges wait in the open. Here the block runs: Q/K/V projected and posted; proj_mlp while they travel;
attention; its output posted; proj_out's MLP columns while it travels; then its attention columns, added. Every
GEMM stays whole (attention/overlap.py says why), and the exchanges run beside the two largest. proj_out as two products added rounds differently from one GEMM: within the bf16
tolerance of every check (a proj_out that is not a plain nn.Linear, LoRA or quantized, runs whole, after).

It applies where the attention is pure Ulysses (torus and ring degree 1) over the torch transport, not compiled,
with no mask, and where nothing else hooks the block (a cache that may skip it); elsewhere the stock forward runs.
`ParallelConfig.overlap_mlp` turns it off.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, _get_qkv_projections
from torch import Tensor

from ..attention.overlap import OverlapPlan, overlap_plan, run_overlapped
from ..kernels.rotary import rotary_qk
from .processors.backend import Route

MLP_HOOK = "streamfusion_overlap_mlp"


class OverlapMlpHook(ModelHook):
    """A Flux single block's forward with its all-to-alls beside its MLP projections (the module docstring)."""

    def new_forward(self, block: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                    temb: Tensor, image_rotary_emb: tuple[Tensor, Tensor] | None = None,
                    joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[Tensor, Tensor]:
        stock = (hidden_states, encoder_hidden_states, temb, image_rotary_emb, joint_attention_kwargs)
        attn = block.attn
        route = getattr(attn.processor, "_parallel_config", None)
        if joint_attention_kwargs or not isinstance(route, Route) or torch.compiler.is_compiling():
            return self.fn_ref.original_forward(*stock)
        text, d = encoder_hidden_states.shape[1], attn.head_dim
        like = hidden_states.new_empty(()).expand(hidden_states.shape[0], text + hidden_states.shape[1],
                                                  attn.heads, d)
        plan = _plan(route, like)
        if plan is None:
            return self.fn_ref.original_forward(*stock)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        residual = hidden_states
        normed, gate = block.norm(hidden_states, emb=temb)
        out_proj = block.proj_out
        split = type(out_proj) is torch.nn.Linear and type(out_proj.weight.data) is torch.Tensor
        inner = attn.heads * d  # proj_out's first columns take the attention, the rest the MLP
        mlp: dict[str, Tensor] = {}

        q, k, v = (x.unflatten(-1, (-1, d)) for x in _get_qkv_projections(attn, normed, None)[:3])
        q, k = attn.norm_q(q), attn.norm_k(k)
        if image_rotary_emb is not None:
            q, k = rotary_qk(q, k, image_rotary_emb)

        def first() -> None:  # Q, K and V travel meanwhile
            mlp["hidden"] = block.act_mlp(block.proj_mlp(normed))

        def last() -> None:  # the attention's output travels meanwhile
            if split:
                mlp["out"] = F.linear(mlp["hidden"], out_proj.weight[:, inner:], out_proj.bias)

        o = run_overlapped(route.ctx, plan, q, k, v, first, last).flatten(2, 3).to(normed.dtype)
        projected = F.linear(o, out_proj.weight[:, :inner]).add_(mlp["out"]) if split else \
            out_proj(torch.cat([o, mlp["hidden"]], dim=2))
        hidden_states = residual + gate.unsqueeze(1) * projected
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text], hidden_states[:, text:]


def _plan(route: Route, like: Tensor) -> OverlapPlan | None:
    """The schedule for a single block's attention shaped `like`, or None: run the stock forward (text after the
    image, or a layout with no all-to-all to run beside)."""
    layout = route.state.layout
    if layout is not None and layout.joint_last:
        return None
    joint, lens = (layout.joint, layout.seq_lens) if layout is not None else (0, None)
    return overlap_plan(route.ctx, like, joint, lens)


def overlap_mlp_hooks(transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, ModelHook, str]]:
    """The hooks for a transformer's Flux single blocks that nothing else hooks (none for other models)."""
    return [(block, OverlapMlpHook(), MLP_HOOK) for block in transformer.modules()
            if type(block) is FluxSingleTransformerBlock and not _hooked(block)]


def _hooked(block: torch.nn.Module) -> bool:
    """Whether another hook wraps the block (a registry stays on a module after its last hook is removed)."""
    registry = getattr(block, "_diffusers_hook", None)
    return registry is not None and bool(registry.hooks)


__all__ = ["MLP_HOOK", "OverlapMlpHook", "overlap_mlp_hooks"]

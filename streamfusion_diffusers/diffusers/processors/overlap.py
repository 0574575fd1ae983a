"""Flux.1's and Qwen-Image's attention with the Ulysses all-to-all hidden behind the projections.

Each is the stock processor (routed to the "streamfusion" backend like any other) that, where the pipelined
schedule applies (attention/overlap.py), projects Q, K, V one head group at a time (row slices of the weights:
views), applies QK-norm and RoPE per group (both act per head), and hands the output projection each group's
column slice of its weight. Elsewhere (overlap off or not applicable, a mask, a swapped attention, fused or
non-plain projections such as LoRA or quantized layers, compiled code) it runs the stock call: Qwen-Image's
unchanged, Flux's as FluxRotaryAttnProcessor makes it (processors/flux.py: diffusers' call with RoPE in one pass,
the lean path through `dispatch_attention_fn`). Flux's twin is therefore installed without head groups asked for
too (routing.py's `TWINS`); its pipeline runs RoPE the same way.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import (QwenDoubleStreamAttnProcessor2_0,
                                                                 apply_rotary_emb_qwen)
from torch import Tensor

from ...attention.overlap import OverlapPlan, overlap_plan, run_overlapped
from ...kernels.rotary import rotary_qk
from .backend import Route
from .flux import FluxRotaryAttnProcessor

QKV = tuple[Tensor, Tensor, Tensor]


def _plain(*modules: torch.nn.Module | None) -> bool:
    """Plain nn.Linear layers with plain weights: what the per-group slices of the weights are taken from."""
    return all(type(m) is torch.nn.Linear and type(m.weight.data) is torch.Tensor for m in modules if m is not None)


def _rows(linear: torch.nn.Linear, x: Tensor, g: int, groups: int, head_dim: int) -> Tensor:
    """Head group g of linear(x), [B, L, H/G, D]: the group's rows of the weight and bias (views)."""
    n = linear.out_features // groups
    bias = linear.bias[g * n:(g + 1) * n] if linear.bias is not None else None
    return F.linear(x, linear.weight[g * n:(g + 1) * n], bias).unflatten(-1, (-1, head_dim))


def _cols(linear: torch.nn.Linear, o: Tensor, g: int, groups: int) -> Tensor:
    """Head group g's share of linear(o_all): o [B, L, H/G * D] through the group's columns of the weight (a
    view); the bias goes with group 0 only."""
    n = linear.in_features // groups
    return F.linear(o, linear.weight[:, g * n:(g + 1) * n], linear.bias if g == 0 else None)


def pipeline_plan(route: Route, like: Tensor, masked: bool, groups: int | None = None) -> OverlapPlan | None:
    """The pipeline for an attention call of `route` shaped `like`, or None: run the stock call (a mask, a swapped
    attention, compiled code, text after the image, or a layout with nothing to hide). groups: as overlap_plan's."""
    layout = route.state.layout
    if masked or route.attention is not None or torch.compiler.is_compiling() or \
            (layout is not None and layout.joint_last):
        return None
    joint, lens = (layout.joint, layout.seq_lens) if layout is not None else (0, None)
    return overlap_plan(route.ctx, like, joint, lens, groups)


class _Overlapped:
    """What both processors share: when the pipeline runs, and the joint blocks' output projection."""

    _parallel_config: Route

    def _plan(self, attn: torch.nn.Module, like: Tensor, masked: bool, *linears: torch.nn.Module | None
              ) -> OverlapPlan | None:
        """The pipeline for this call; None: run the stock call (also where the projections are not plain
        layers whose weights can be sliced by head group)."""
        if not _plain(*linears) or getattr(attn, "fused_projections", False):
            return None
        return pipeline_plan(self._parallel_config, like, masked)

    def _run(self, plan: OverlapPlan, like: Tensor, project: Callable[[int], QKV],
             out_project: Callable[[int, Tensor], tuple[Tensor, ...]] | None) -> Tensor | tuple[Tensor, ...]:
        return run_overlapped(self._parallel_config.ctx, plan, like, project, out_project)

    @staticmethod
    def _joint_out(attn: torch.nn.Module, text: int, groups: int) -> Callable[[int, Tensor], tuple[Tensor, ...]]:
        """Group g's output [B, text + image, H/G, D] -> its shares of (image out, text out)."""
        def out_project(g: int, o: Tensor) -> tuple[Tensor, Tensor]:
            txt, img = o.flatten(2, 3).split_with_sizes([text, o.shape[1] - text], dim=1)
            return _cols(attn.to_out[0], img, g, groups), _cols(attn.to_add_out, txt, g, groups)
        return out_project


class FluxOverlapAttnProcessor(_Overlapped, FluxRotaryAttnProcessor):
    """diffusers' FluxAttnProcessor (joint and single blocks) with the all-to-all pipelined by head groups, and
    RoPE in one pass on either path."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        stock = (attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        if (self._parallel_config.ctx.config.overlap_groups or 1) == 1:  # no pipeline asked for: the lean path
            return super().__call__(*stock)
        joint_block = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        text = encoder_hidden_states.shape[1] if joint_block else 0
        b, d = hidden_states.shape[0], attn.head_dim
        like = hidden_states.new_empty(()).expand(b, text + hidden_states.shape[1], attn.heads, d)
        extra = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.to_out[0], attn.to_add_out) \
            if joint_block else ()
        plan = self._plan(attn, like, attention_mask is not None, attn.to_q, attn.to_k, attn.to_v, *extra)
        if plan is None:
            return super().__call__(*stock)
        groups = plan.groups

        def project(g: int) -> QKV:
            q = attn.norm_q(_rows(attn.to_q, hidden_states, g, groups, d))
            k = attn.norm_k(_rows(attn.to_k, hidden_states, g, groups, d))
            v = _rows(attn.to_v, hidden_states, g, groups, d)
            if joint_block:
                e = encoder_hidden_states
                q = torch.cat([attn.norm_added_q(_rows(attn.add_q_proj, e, g, groups, d)), q], dim=1)
                k = torch.cat([attn.norm_added_k(_rows(attn.add_k_proj, e, g, groups, d)), k], dim=1)
                v = torch.cat([_rows(attn.add_v_proj, e, g, groups, d), v], dim=1)
            if image_rotary_emb is not None:
                q, k = rotary_qk(q, k, image_rotary_emb)
            return q, k, v

        if not joint_block:
            return self._run(plan, like, project, None).flatten(2, 3)
        img, txt = self._run(plan, like, project, self._joint_out(attn, text, groups))
        return attn.to_out[1](img), txt


class QwenImageOverlapAttnProcessor(_Overlapped, QwenDoubleStreamAttnProcessor2_0):
    """diffusers' QwenDoubleStreamAttnProcessor2_0 with the all-to-all pipelined by head groups."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 encoder_hidden_states_mask: Tensor | None = None, attention_mask: Tensor | None = None,
                 image_rotary_emb: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        stock = (attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                 image_rotary_emb)
        if encoder_hidden_states is None:
            return super().__call__(*stock)
        # a key mask the sharding hook found to keep every key changes nothing; any other runs the stock call
        checked = "encoder_hidden_states_mask" in getattr(self._parallel_config.state, "masks_checked", ())
        masked = attention_mask is not None or (encoder_hidden_states_mask is not None and not checked)
        text, b, d = encoder_hidden_states.shape[1], hidden_states.shape[0], attn.inner_dim // attn.heads
        like = hidden_states.new_empty(()).expand(b, text + hidden_states.shape[1], attn.heads, d)
        plan = self._plan(attn, like, masked, attn.to_q, attn.to_k, attn.to_v, attn.add_q_proj, attn.add_k_proj,
                          attn.add_v_proj, attn.to_out[0], attn.to_add_out)
        if plan is None:
            return super().__call__(*stock)
        groups = plan.groups

        def norm(module: torch.nn.Module | None, x: Tensor) -> Tensor:
            return x if module is None else module(x)

        def project(g: int) -> QKV:
            img = [_rows(m, hidden_states, g, groups, d) for m in (attn.to_q, attn.to_k, attn.to_v)]
            txt = [_rows(m, encoder_hidden_states, g, groups, d)
                   for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            img[0], img[1] = norm(attn.norm_q, img[0]), norm(attn.norm_k, img[1])
            txt[0], txt[1] = norm(attn.norm_added_q, txt[0]), norm(attn.norm_added_k, txt[1])
            if image_rotary_emb is not None:
                img_freqs, txt_freqs = image_rotary_emb
                img[:2] = [apply_rotary_emb_qwen(x, img_freqs, use_real=False) for x in img[:2]]
                txt[:2] = [apply_rotary_emb_qwen(x, txt_freqs, use_real=False) for x in txt[:2]]
            return tuple(torch.cat([t, i], dim=1) for t, i in zip(txt, img))

        img, txt = self._run(plan, like, project, self._joint_out(attn, text, groups))
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)
        return img, txt


# stock processor -> its overlapped twin, which `parallelize` installs in its place (routing.py) where head
# groups are asked for
OVERLAPPED: dict[type, type] = {FluxAttnProcessor: FluxOverlapAttnProcessor,
                                QwenDoubleStreamAttnProcessor2_0: QwenImageOverlapAttnProcessor}

__all__ = ["OVERLAPPED", "FluxOverlapAttnProcessor", "QwenImageOverlapAttnProcessor", "pipeline_plan"]

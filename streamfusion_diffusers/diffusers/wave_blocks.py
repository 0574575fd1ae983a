"""diffusers' Flux and CogVideoX blocks cut into waves for `waves.run_waves`, and the hook that runs them so.

Each class is its diffusers block's forward, line for line, split at the attention call into `pre` and `post`
over a range of local tokens [text ; image]. The adaptive-norm modulation (a GEMV over the whole embedding
weight, the same for every token) is computed once per block call, not once per wave.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.hooks import ModelHook
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from torch import Tensor

from ..core.context import ParallelContext
from .processors import CogVideoXSPAttnProcessor, FluxSPAttnProcessor, ShardState
from .waves import auto_waves, run_waves, sm_count

WAVES_HOOK = "streamfusion_waves"
Rope = tuple[Tensor, Tensor] | None


def _cut(text: Tensor, image: Tensor, start: int, stop: int) -> tuple[Tensor, Tensor]:
    """Local tokens [start, stop) of [text ; image] as (their text rows, their image rows)."""
    n = text.shape[1]
    return text[:, min(start, n):min(stop, n)], image[:, max(start - n, 0):max(stop - n, 0)]


def _rows(rope: Rope, start: int, stop: int) -> Rope:
    return None if rope is None else (rope[0][start:stop], rope[1][start:stop])


def _modulate(norm: torch.nn.Module, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return norm(x) * (1 + scale[:, None]) + shift[:, None]


class _Waves:
    """What every block cut shares: its inputs, the per-wave state `pre` hands `post`, the outputs by wave.
    `processor`: the SP processor class whose static project / output steps the cut runs per wave (whatever
    processor the module runs: `parallelize` routes Flux's stock one to our attention backend)."""

    processor: type

    def __init__(self, block: torch.nn.Module, attn: torch.nn.Module, hidden: Tensor, encoder: Tensor,
                 temb: Tensor, rope: Rope):
        self.block, self.attn = block, attn
        self.hidden, self.encoder, self.temb, self.rope = hidden, encoder, temb, rope
        self.saved: dict[int, tuple] = {}
        self.texts: list[Tensor] = []
        self.images: list[Tensor] = []

    def texts_and_images(self) -> tuple[Tensor, Tensor]:
        return torch.cat(self.texts, dim=1), torch.cat(self.images, dim=1)


class FluxJointWaves(_Waves):
    """FluxTransformerBlock.forward; returns (encoder_hidden_states, hidden_states)."""

    processor = FluxSPAttnProcessor

    def __init__(self, block: FluxTransformerBlock, **inputs: Any):
        super().__init__(block, block.attn, **inputs)
        self.mod = block.norm1.linear(block.norm1.silu(self.temb)).chunk(6, dim=1)
        self.c_mod = block.norm1_context.linear(block.norm1_context.silu(self.temb)).chunk(6, dim=1)

    def pre(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
        txt, img = _cut(self.encoder, self.hidden, start, stop)
        self.saved[start] = (txt, img)
        norm_img = _modulate(self.block.norm1.norm, img, self.mod[0], self.mod[1])
        norm_txt = _modulate(self.block.norm1_context.norm, txt, self.c_mod[0], self.c_mod[1])
        return self.processor.project(self.attn, norm_img, norm_txt, _rows(self.rope, start, stop))

    def post(self, start: int, stop: int, out: Tensor) -> None:
        blk, (txt, img) = self.block, self.saved.pop(start)
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.mod
        _, _, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.c_mod
        attn_output, context_attn_output = self.processor.output(self.attn, out, txt.shape[1])
        img = img + gate_msa.unsqueeze(1) * attn_output
        norm_img = blk.norm2(img) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        img = img + gate_mlp.unsqueeze(1) * blk.ff(norm_img)
        txt = txt + c_gate_msa.unsqueeze(1) * context_attn_output
        norm_txt = blk.norm2_context(txt) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        txt = txt + c_gate_mlp.unsqueeze(1) * blk.ff_context(norm_txt)
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        self.texts.append(txt)
        self.images.append(img)

    def result(self) -> tuple[Tensor, Tensor]:
        return self.texts_and_images()


class FluxSingleWaves(_Waves):
    """FluxSingleTransformerBlock.forward; returns (encoder_hidden_states, hidden_states)."""

    processor = FluxSPAttnProcessor

    def __init__(self, block: FluxSingleTransformerBlock, **inputs: Any):
        super().__init__(block, block.attn, **inputs)
        self.mod = block.norm.linear(block.norm.silu(self.temb)).chunk(3, dim=1)

    def pre(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
        txt, img = _cut(self.encoder, self.hidden, start, stop)
        residual = torch.cat([txt, img], dim=1)
        norm = _modulate(self.block.norm.norm, residual, self.mod[0], self.mod[1])
        mlp = self.block.act_mlp(self.block.proj_mlp(norm))
        self.saved[start] = (residual, mlp, txt.shape[1])
        return self.processor.project(self.attn, norm, None, _rows(self.rope, start, stop))

    def post(self, start: int, stop: int, out: Tensor) -> None:
        residual, mlp, text_len = self.saved.pop(start)
        hidden = torch.cat([self.processor.output(self.attn, out, None), mlp], dim=2)
        hidden = residual + self.mod[2].unsqueeze(1) * self.block.proj_out(hidden)
        if hidden.dtype == torch.float16:
            hidden = hidden.clip(-65504, 65504)
        self.texts.append(hidden[:, :text_len])
        self.images.append(hidden[:, text_len:])

    def result(self) -> tuple[Tensor, Tensor]:
        return self.texts_and_images()


class CogVideoXWaves(_Waves):
    """CogVideoXBlock.forward; returns (hidden_states, encoder_hidden_states). RoPE covers video rows only."""

    processor = CogVideoXSPAttnProcessor

    def __init__(self, block: CogVideoXBlock, **inputs: Any):
        super().__init__(block, block.attn1, **inputs)
        self.mod1 = block.norm1.linear(block.norm1.silu(self.temb)).chunk(6, dim=1)
        self.mod2 = block.norm2.linear(block.norm2.silu(self.temb)).chunk(6, dim=1)

    def pre(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
        txt, img = _cut(self.encoder, self.hidden, start, stop)
        self.saved[start] = (txt, img)
        shift, scale, _, enc_shift, enc_scale, _ = self.mod1
        norm = self.block.norm1.norm
        first = max(start - self.encoder.shape[1], 0)
        return self.processor.project(self.attn, _modulate(norm, img, shift, scale),
                                      _modulate(norm, txt, enc_shift, enc_scale),
                                      _rows(self.rope, first, first + img.shape[1]))

    def post(self, start: int, stop: int, out: Tensor) -> None:
        txt, img = self.saved.pop(start)
        attn_img, attn_txt = self.processor.output(self.attn, out, txt.shape[1])
        img = img + self.mod1[2][:, None, :] * attn_img
        txt = txt + self.mod1[5][:, None, :] * attn_txt
        shift, scale, gate_ff, enc_shift, enc_scale, enc_gate_ff = self.mod2
        norm = self.block.norm2.norm
        ff = self.block.ff(torch.cat([_modulate(norm, txt, enc_shift, enc_scale),
                                      _modulate(norm, img, shift, scale)], dim=1))
        self.images.append(img + gate_ff[:, None, :] * ff[:, txt.shape[1]:])
        self.texts.append(txt + enc_gate_ff[:, None, :] * ff[:, :txt.shape[1]])

    def result(self) -> tuple[Tensor, Tensor]:
        text, image = self.texts_and_images()
        return image, text


CUTS = {FluxTransformerBlock: FluxJointWaves, FluxSingleTransformerBlock: FluxSingleWaves,
        CogVideoXBlock: CogVideoXWaves}


class WavesHook(ModelHook):
    """Runs a block's forward as `waves` waves (or "auto": `waves.auto_waves` from the GPU's SM count)."""

    def __init__(self, ctx: ParallelContext, state: ShardState, waves: int | str):
        super().__init__()
        self.ctx, self.state, self.waves = ctx, state, waves
        self.signature: inspect.Signature | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        arguments = self.signature.bind(*args, **kwargs).arguments
        layout = self.state.layout
        waves = self.waves
        if waves == "auto":
            waves = auto_waves(min(layout.seq_lens), arguments["hidden_states"].shape[-1], sm_count())
        extra = arguments.get("joint_attention_kwargs") or arguments.get("attention_kwargs")
        if waves == 1 or extra:  # IP-adapter style extra attention arguments: the stock, one-wave forward
            return self.fn_ref.original_forward(*args, **kwargs)
        cut = CUTS[type(module)](module, hidden=arguments["hidden_states"],
                                 encoder=arguments["encoder_hidden_states"], temb=arguments["temb"],
                                 rope=arguments.get("image_rotary_emb"))
        run_waves(cut, waves, self.ctx, layout, cut.attn.heads)
        return cut.result()


def blocks_to_cut(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks a waves hook goes on: every Flux joint / single block, every CogVideoX block."""
    return [m for m in transformer.modules() if type(m) in CUTS]


__all__ = ["CUTS", "CogVideoXWaves", "FluxJointWaves", "FluxSingleWaves", "WAVES_HOOK", "WavesHook",
           "blocks_to_cut"]

"""LTX-Video: diffusers' `_cp_plan` without its text split.

LTX attends to the text only in cross-attention (`attn2`); diffusers splits the text (and its mask) and lets its
ring pass the text keys around. Here the text stays whole on every rank, so `attn2` runs locally, exactly, with
its `encoder_attention_mask`, and moves nothing; only the video self-attention (`attn1`) is split.
"""
from diffusers import LTXVideoTransformer3DModel

from .plan import ModelPlan

_TEXT = ("encoder_hidden_states", "encoder_attention_mask")

PLAN = ModelPlan(
    cp_plan={name: ({k: v for k, v in spec.items() if k not in _TEXT} if name == "" else spec)
             for name, spec in LTXVideoTransformer3DModel._cp_plan.items()},
    source="diffusers, text kept whole",
    local_attention=("transformer_blocks.*.attn2",),
)

"""HunyuanVideo (diffusers has no `_cp_plan` for it): split the video and text tokens at the first dual block.

Attention sees [video ; text] in both block kinds; the rotary table (cos, sin: [N_video, D], from `rope`) is
cut with the video. The forward builds a key mask from `encoder_attention_mask` (text padding): it is checked
once per forward and refused unless it keeps every key.
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .plan import ModelPlan

PLAN = ModelPlan(
    cp_plan={
        "rope": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
                 1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    },
    source="streamfusion",
    local_attention=("context_embedder.*",),  # the text refiner attends the whole text, before the split
    key_masks=("encoder_attention_mask",),
    text_last=True,
)

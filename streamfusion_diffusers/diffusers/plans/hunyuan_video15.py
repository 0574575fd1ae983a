"""HunyuanVideo 1.5 (diffusers has no `_cp_plan` for it): HunyuanVideo's split, with the padding of its text dropped.

Attention sees [video ; text] rows (text last); the rotary table (cos, sin: [N_video, D], from `rope`) is cut with
the video. The forward packs the image, ByT5 and MLLM tokens into one text stream, each row's valid tokens first,
and masks the rest as queries and keys (text-to-video masks every image token): no valid query attends them, so
the columns no batch row keeps are dropped with their tokens before the cut (`KeptText`), and what is left is a
mask that keeps every key (rows of unequal valid lengths leave a per-query mask, which the split refuses).
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .plan import KeptText, ModelPlan

PLAN = ModelPlan(
    cp_plan={
        "rope": {0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
                 1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)},
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
        },
        "transformer_blocks.*": {"attention_mask": KeptText(split_dim=1, expected_dims=2)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    },
    source="streamfusion",
    local_attention=("context_embedder.*",),  # the text refiner attends the whole text, before the split
    text_last=True,
)

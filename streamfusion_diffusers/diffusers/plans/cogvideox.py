"""CogVideoX 1.0 and 1.5 (diffusers has no `_cp_plan` for them): split after the patch embedding.

Every rank embeds the whole latent video (one cheap projection); the first block cuts the video and text
tokens, every block its rotary table (cos, sin: [N, D]), and the video tokens are gathered after `proj_out`.
The stock processor calls torch's SDPA directly, so ours stands in for it.
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0

from ..processors import CogVideoXSPAttnProcessor
from .plan import ModelPlan

PLAN = ModelPlan(
    cp_plan={
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
        },
        "transformer_blocks.*": {
            "image_rotary_emb": [ContextParallelInput(split_dim=0, expected_dims=2)] * 2,
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    },
    source="streamfusion",
    adapters={CogVideoXAttnProcessor2_0: CogVideoXSPAttnProcessor,
              FusedCogVideoXAttnProcessor2_0: CogVideoXSPAttnProcessor},
)

"""Z-Image (diffusers has no `_cp_plan` for it): the unified [image ; caption] sequence split at the main layers.

The forward refines the image and the caption tokens apart (each refiner attends only its own stream: kept
whole, local), then builds one padded sequence of both with its rotary table (`freqs_cis`, complex [B, L, D/2])
and, for a batch of unequal lengths, a key mask; every main layer takes all three, so they are cut alike, as one
stream, and the final layer's projection is gathered back before the forward unpatchifies it. Omni mode (input
images: [captions ; latents ; SigLIP tokens], each refined apart) also tags every token noisy or clean
(`noise_mask`, [B, L]) for the main and final layers' per-token modulation: cut with the sequence at both.
"""
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from .plan import ModelPlan

PLAN = ModelPlan(
    cp_plan={
        "layers.0": {"x": ContextParallelInput(split_dim=1, expected_dims=3)},
        "layers.*": {
            "freqs_cis": ContextParallelInput(split_dim=1, expected_dims=3),
            "attn_mask": ContextParallelInput(split_dim=1, expected_dims=2),
            "noise_mask": ContextParallelInput(split_dim=1, expected_dims=2),
        },
        "all_final_layer.*": {"noise_mask": ContextParallelInput(split_dim=1, expected_dims=2)},
        "all_final_layer.*.linear": ContextParallelOutput(gather_dim=1, expected_dims=3),
    },
    source="streamfusion",
    local_attention=("noise_refiner.*", "context_refiner.*", "siglip_refiner.*"),  # one stream each, whole
    image_input="x",
)

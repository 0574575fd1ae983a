"""Transformer configs: the real FLUX.1-dev and CogVideoX-5b ones, and tiny ones for tests and the CPU demo.

The real dicts are the `transformer/config.json` of black-forest-labs/FLUX.1-dev and THUDM/CogVideoX-5b,
written out so that a real-size model can be built (with random weights) where no model hub is reachable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLUX_DEV: dict[str, Any] = {
    "attention_head_dim": 128,
    "axes_dims_rope": (16, 56, 56),
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}

COGVIDEOX_5B: dict[str, Any] = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 16,
    "max_text_seq_length": 226,
    "norm_elementwise_affine": True,
    "norm_eps": 1e-05,
    "num_attention_heads": 48,
    "num_layers": 42,
    "out_channels": 16,
    "patch_size": 2,
    "sample_frames": 49,
    "sample_height": 60,
    "sample_width": 90,
    "spatial_interpolation_scale": 1.875,
    "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "timestep_activation_fn": "silu",
    "use_rotary_positional_embeddings": True,
}

# The VAEs' `vae/config.json` of the same two models (only what differs from diffusers' defaults where it is long).
FLUX_DEV_VAE: dict[str, Any] = {
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

COGVIDEOX_5B_VAE: dict[str, Any] = {  # AutoencoderKLCogVideoX's defaults are CogVideoX's VAE; 5b scales by 0.7
    "scaling_factor": 0.7,
}

# 8 heads: enough for Ulysses over 8 ranks; one joint and one single block, so both Flux block kinds run.
TINY_FLUX: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 6, 6),
    "guidance_embeds": False,
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "num_single_layers": 1,
    "patch_size": 1,
    "pooled_projection_dim": 32,
}

# max_text_seq_length 10 divides neither 4 nor 8 ranks, like the real 226: text goes in as joint tokens.
TINY_COGVIDEOX: dict[str, Any] = {
    "attention_head_dim": 16,
    "in_channels": 4,
    "max_text_seq_length": 10,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": 2,
    "sample_frames": 9,
    "sample_height": 8,
    "sample_width": 8,
    "temporal_compression_ratio": 4,
    "text_embed_dim": 32,
    "time_embed_dim": 32,
    "use_rotary_positional_embeddings": True,
}

# Tiny configs of the newer models: 8 heads (Ulysses over 8 ranks), one block of each kind, widths of 16 per head.
TINY_FLUX2: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 4, 4, 4),
    "guidance_embeds": True,
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "num_single_layers": 1,
    "timestep_guidance_channels": 32,
}

TINY_WAN: dict[str, Any] = {
    "attention_head_dim": 16,
    "ffn_dim": 64,
    "freq_dim": 32,
    "in_channels": 4,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": (1, 2, 2),
    "rope_max_seq_len": 64,
    "text_dim": 32,
}

TINY_QWEN_IMAGE: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 6, 6),
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": 2,
}


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its family, transformer config, and the defaults `streamfusion generate` runs it with."""

    family: str  # "flux" or "cogvideox"
    transformer: dict[str, Any]
    height: int
    width: int
    frames: int
    steps: int
    max_sequence_length: int
    guidance_scale: float
    vae_scale: int  # pixels per latent pixel, each side


MODELS: dict[str, ModelSpec] = {
    "tiny-flux": ModelSpec("flux", TINY_FLUX, 64, 64, 1, 4, 16, 3.5, vae_scale=2),
    "flux-dev": ModelSpec("flux", FLUX_DEV, 1024, 1024, 1, 28, 512, 3.5, vae_scale=8),
    "tiny-cogvideox": ModelSpec("cogvideox", TINY_COGVIDEOX, 64, 64, 9, 4, 10, 6.0, vae_scale=8),
    "cogvideox-5b": ModelSpec("cogvideox", COGVIDEOX_5B, 480, 720, 49, 50, 226, 6.0, vae_scale=8),
}

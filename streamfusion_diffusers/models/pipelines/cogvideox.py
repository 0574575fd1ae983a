"""CogVideoX (`CogVideoXPipeline`): a T5-XXL text encoder, its 3D causal VAE, CFG in one call of batch 2."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import COGVIDEOX_5B_VAE, ModelSpec
from .base import PipelineFamily, small_t5, t5_xxl

SCHEDULER: dict[str, Any] = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                             "clip_sample": False, "num_train_timesteps": 1000, "prediction_type": "v_prediction",
                             "rescale_betas_zero_snr": True, "set_alpha_to_one": True, "snr_shift_scale": 1.0,
                             "steps_offset": 0, "timestep_spacing": "trailing"}


class CogVideoX(PipelineFamily):
    name, pipeline_class, transformer_class = "cogvideox", "CogVideoXPipeline", "CogVideoXTransformer3DModel"
    diffusers_cp = False  # the plan is ours (diffusers/plans/cogvideox.py)

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline

        from ..tokenizers import t5_tokenizer

        cfg = spec.transformer
        tok = t5_tokenizer(spec.max_sequence_length)
        vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, latent_channels=cfg["in_channels"],
                                     down_block_types=("CogVideoXDownBlock3D",) * 4,
                                     up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8,) * 4,
                                     layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)
        return CogVideoXPipeline(tokenizer=tok, text_encoder=small_t5(cfg["text_embed_dim"], tok), vae=vae,
                                 scheduler=CogVideoXDDIMScheduler(**SCHEDULER), **transformers)

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLCogVideoX

        return {"text_encoder": t5_xxl(pipe.tokenizer), "vae": AutoencoderKLCogVideoX(**COGVIDEOX_5B_VAE)}


FAMILY = CogVideoX()

"""Wan 2.1 / 2.2 (`WanPipeline`): a UMT5-XXL text encoder, Wan's 3D causal VAE, CFG as two calls per step.

Wan 2.2 TI2V-5B: its own VAE (z_dim 48, 16x spatial: a 2 x 2 pixel patch, then 8x) and one timestep per
latent token (`expand_timesteps`). Wan 2.2 T2V-A14B: two experts, `transformer` for the high-noise steps
(t >= boundary_ratio x 1000) and `transformer_2` after, on Wan 2.1's VAE (z_dim 16, 8x).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily

UMT5_XXL: dict[str, Any] = {  # the encoder of google/umt5-xxl (Wan's text_encoder)
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
}
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json where it differs from AutoencoderKLWan's defaults (Wan 2.1's VAE,
# which A14B uses)
WAN22_VAE: dict[str, Any] = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "in_channels": 12, "out_channels": 12, "patch_size": 2,
    "scale_factor_spatial": 16, "is_residual": True,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}


def _umt5(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(**config, pad_token_id=tokenizer.pad_token_id,
                                       eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))


class Wan(PipelineFamily):
    name, pipeline_class, transformer_class = "wan", "WanPipeline", "WanTransformer3DModel"

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLWan, WanPipeline

        from ..tokenizers import t5_tokenizer

        cfg = spec.transformer
        tok = t5_tokenizer(spec.max_sequence_length)
        z = cfg["in_channels"]
        stats = {"z_dim": z, "latents_mean": [0.0] * z, "latents_std": [1.0] * z}
        if spec.extras.get("expand_timesteps"):  # Wan 2.2's VAE: a 2 x 2 pixel patch in, residual blocks
            vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, in_channels=12, out_channels=12,
                                   patch_size=2, scale_factor_spatial=16, is_residual=True, **stats)
        else:
            vae = AutoencoderKLWan(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1, **stats)
        encoder = _umt5(tok, vocab_size=len(tok), d_model=cfg["text_dim"], d_kv=16, d_ff=64, num_layers=1,
                        num_heads=2)
        return WanPipeline(tokenizer=tok, text_encoder=encoder, vae=vae, scheduler=self.scheduler(spec),
                           **transformers, **self.pipeline_kwargs(spec))

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLWan

        vae = WAN22_VAE if spec.extras.get("expand_timesteps") else {}
        return {"text_encoder": _umt5(pipe.tokenizer, **UMT5_XXL), "vae": AutoencoderKLWan(**vae)}

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> int:
        return 0  # the text enters by cross-attention

    def image_pipeline(self, spec: ModelSpec, pipe: Any) -> Any:
        """Wan 2.2 TI2V's image-to-video: `WanImageToVideoPipeline` over the same components (parallelized with
        them), its first latent frame the image's (no image encoder: TI2V conditions by the latents alone)."""
        from diffusers import WanImageToVideoPipeline, WanPipeline

        class ImageToVideo(WanImageToVideoPipeline):  # its prompt cleaning needs ftfy; WanPipeline's only if there
            _get_t5_prompt_embeds = WanPipeline._get_t5_prompt_embeds

        image = ImageToVideo(**pipe.components, **self.pipeline_kwargs(spec))
        image.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
        return image

    def transformer_names(self, spec: ModelSpec) -> tuple[str, ...]:
        return ("transformer", "transformer_2") if "boundary_ratio" in spec.extras else ("transformer",)

    def pipeline_kwargs(self, spec: ModelSpec) -> dict[str, Any]:
        return {k: spec.extras[k] for k in ("boundary_ratio", "expand_timesteps") if k in spec.extras}

    @staticmethod
    def scheduler(spec: ModelSpec) -> Any:
        """The Wan repositories' scheduler: UniPC over flow-matching sigmas, shifted by flow_shift."""
        from diffusers import UniPCMultistepScheduler

        with torch.device("cpu"):  # it keeps its sigmas on the CPU (copied there, which a meta build cannot)
            return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                           flow_shift=spec.extras.get("flow_shift", 5.0), num_train_timesteps=1000)


FAMILY = Wan()

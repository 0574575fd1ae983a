"""Flux.1 (`FluxPipeline`): CLIP-L and T5-XXL text encoders, a 2D AutoencoderKL, distilled guidance and optional
true CFG (a second call with a negative prompt)."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import FLUX_DEV_VAE, ModelSpec
from .base import PipelineFamily, small_t5, t5_xxl

SCHEDULER: dict[str, Any] = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096,
                             "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                             "use_dynamic_shifting": True}
CLIP_L: dict[str, Any] = {  # the text model of openai/clip-vit-large-patch14 (Flux.1-dev's text_encoder)
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
}


def _clip(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**config, bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


class Flux(PipelineFamily):
    name, pipeline_class, transformer_class = "flux", "FluxPipeline", "FluxTransformer2DModel"
    cfg_by = "true_cfg_scale"

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

        from ..tokenizers import clip_tokenizer, t5_tokenizer

        cfg = spec.transformer
        blocks = spec.vae_scale.bit_length()  # one more than the VAE's downsamplings
        tok, tok2 = clip_tokenizer(), t5_tokenizer(spec.max_sequence_length)
        hidden = cfg["pooled_projection_dim"]
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=cfg["in_channels"] // 4,
                            block_out_channels=(8,) * blocks, layers_per_block=1, norm_num_groups=2,
                            down_block_types=("DownEncoderBlock2D",) * blocks,
                            up_block_types=("UpDecoderBlock2D",) * blocks, use_quant_conv=False,
                            use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
        clip = _clip(tok, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                     num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden)
        return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=clip,
                            tokenizer=tok, text_encoder_2=small_t5(cfg["joint_attention_dim"], tok2),
                            tokenizer_2=tok2, **transformers)

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKL

        return {"text_encoder": _clip(pipe.tokenizer, **CLIP_L), "text_encoder_2": t5_xxl(pipe.tokenizer_2),
                "vae": AutoencoderKL(**FLUX_DEV_VAE)}


FAMILY = Flux()

"""Z-Image (`ZImagePipeline`): a Qwen3-4B text encoder (its second-to-last hidden states, the prompt's own tokens
after a chat template, unpadded), Flux.1's 2D AutoencoderKL, a single-stream transformer over [image ; caption].

Z-Image-Turbo is distilled: guidance_scale 0 runs one call per step (above 0 the pipeline batches a negative
prompt beside it, which the CFG split does not take apart).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import FLUX_DEV_VAE, ModelSpec
from .base import PipelineFamily

SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
QWEN3_4B: dict[str, Any] = {  # Tongyi-MAI/Z-Image-Turbo text_encoder/config.json (Qwen3-4B)
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "attention_bias": False,
}


def _qwen3(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    return Qwen3Model(Qwen3Config(**config, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id))


class ZImage(PipelineFamily):
    name, pipeline_class, transformer_class = "z-image", "ZImagePipeline", "ZImageTransformer2DModel"
    cfg_by = None  # the pipeline's CFG is one batch of lists, not two calls: nothing for the CFG split
    diffusers_cp = False

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline

        from ..tokenizers import qwen_chat_tokenizer

        cfg = spec.transformer
        tok = qwen_chat_tokenizer(spec.max_sequence_length)
        blocks = spec.vae_scale.bit_length()  # one more than the VAE's downsamplings
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=cfg["in_channels"],
                            block_out_channels=(8,) * blocks, layers_per_block=1, norm_num_groups=2,
                            down_block_types=("DownEncoderBlock2D",) * blocks,
                            up_block_types=("UpDecoderBlock2D",) * blocks, use_quant_conv=False,
                            use_post_quant_conv=False, scaling_factor=FLUX_DEV_VAE["scaling_factor"],
                            shift_factor=FLUX_DEV_VAE["shift_factor"])
        hidden = cfg["cap_feat_dim"]
        # two layers: the pipeline reads the second-to-last hidden states
        encoder = _qwen3(tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2, vocab_size=len(tok))
        return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=encoder,
                              tokenizer=tok, **transformers)

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKL

        return {"text_encoder": _qwen3(pipe.tokenizer, **QWEN3_4B),
                "vae": AutoencoderKL(**FLUX_DEV_VAE)}  # Flux.1's VAE

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> None:
        return None  # the prompt's own tokens, unpadded


FAMILY = ZImage()

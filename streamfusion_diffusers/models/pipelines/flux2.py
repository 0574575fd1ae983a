"""Flux.2 (`Flux2Pipeline`): a Mistral-Small-3.1-24B text encoder (three of its hidden layers, stacked), the Flux.2
VAE (AutoencoderKLFlux2, 32 latent channels, batch-normed 2 x 2 patches), distilled guidance only (one call per
step).

Real size, the 24B encoder (48 GB in bfloat16) and the 32B transformer (64 GB) do not fit one 80 GB GPU together:
`encode_first` makes `streamfusion generate` encode the prompt, free the encoder, then build the transformer.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily
from .flux import SCHEDULER

MISTRAL_SMALL_31: dict[str, Any] = {  # black-forest-labs/FLUX.2-dev text_encoder/config.json (Mistral Small 3.1 24B)
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                    "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 131072, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                    "rope_theta": 1000000000.0, "sliding_window": None},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                      "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "image_size": 1540,
                      "patch_size": 14, "rope_theta": 10000.0},
    "spatial_merge_size": 2, "image_token_index": 10, "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu", "vision_feature_layer": -1, "tie_word_embeddings": False,
}


def _mistral3(tokenizer: Any, config: dict[str, Any]) -> nn.Module:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {**config["text_config"], "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id}
    return Mistral3ForConditionalGeneration(Mistral3Config(**{**config, "text_config": text}))


MIN_SIDE, MAX_RATIO = 64, 8  # the smallest side and the most elongated shape of a reference Flux.2 takes


class Flux2(PipelineFamily):
    name, pipeline_class, transformer_class = "flux2", "Flux2Pipeline", "Flux2Transformer2DModel"
    cfg_by = None  # guidance-distilled: guidance_scale is an input of the one call per step
    encode_first = True

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline

        from ..tokenizers import mistral_tokenizer

        cfg = spec.transformer
        tok = mistral_tokenizer(spec.max_sequence_length)
        blocks = spec.vae_scale.bit_length()  # one more than the VAE's downsamplings
        vae = AutoencoderKLFlux2(latent_channels=cfg["in_channels"] // 4, block_out_channels=(8,) * blocks,
                                 down_block_types=("DownEncoderBlock2D",) * blocks,
                                 up_block_types=("UpDecoderBlock2D",) * blocks, layers_per_block=1,
                                 norm_num_groups=2)
        # the pipeline stacks hidden layers 10, 20 and 30: 30 narrow layers, a third of the text width each
        width = cfg["joint_attention_dim"] // 3
        encoder = _mistral3(tok, {
            "text_config": {"model_type": "mistral", "hidden_size": width, "intermediate_size": 2 * width,
                            "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": width // 2, "vocab_size": len(tok)},
            "vision_config": {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "image_size": 56},
            "image_token_index": len(tok)})
        return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=encoder,
                             tokenizer=tok, **transformers)

    def image_refusal(self, width: int, height: int) -> str | None:
        """Flux2ImageProcessor.check_image_input's limits, which the pipeline applies to every reference."""
        if min(width, height) < MIN_SIDE:
            return (f"{width}x{height} pixels: Flux.2 takes input images of at least {MIN_SIDE} pixels a side; "
                    f"upscale it")
        if max(width, height) > MAX_RATIO * min(width, height):
            return f"{width}x{height} pixels: Flux.2 takes input images of at most {MAX_RATIO}:1; crop it"
        return None

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLFlux2  # its defaults are Flux.2's VAE

        return {"text_encoder": _mistral3(pipe.tokenizer, MISTRAL_SMALL_31), "vae": AutoencoderKLFlux2()}


FAMILY = Flux2()

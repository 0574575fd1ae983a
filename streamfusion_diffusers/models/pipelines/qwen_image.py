"""Qwen-Image (`QwenImagePipeline`): a Qwen2.5-VL-7B text encoder (its last hidden states after a chat-template
prefix the pipeline drops), a 2D-in-3D VAE (AutoencoderKLQwenImage), true CFG as a second call with a negative
prompt, no distilled guidance."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily

SCHEDULER: dict[str, Any] = {  # Qwen/Qwen-Image scheduler/scheduler_config.json
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
    "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
QWEN25_VL_7B: dict[str, Any] = {  # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct)
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                    "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
                    "tie_word_embeddings": False},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                      "hidden_act": "silu", "in_channels": 3},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}


def _qwen25_vl(tokenizer: Any, config: dict[str, Any]) -> nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = {**config["text_config"], "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**{**config, "text_config": text}))


def tiny_qwen_image(pipeline: type, spec: ModelSpec, transformers: dict[str, nn.Module], tok: Any,
                    **components: Any) -> Any:
    """A Qwen-Image pipeline class (text-to-image or edit) around `transformers` with a one-layer Qwen2.5-VL of the
    text width and a small VAE of the real latent channels; the vision tokens are the tokenizer's where it has
    them (the edit's processor puts them in the prompt), else ids past its vocabulary."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler

    cfg = spec.transformer
    z = cfg["out_channels"]
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 latents_mean=[0.0] * z, latents_std=[1.0] * z)
    hidden = cfg["joint_attention_dim"]
    vocab = tok.get_vocab()
    image, start, end = (vocab.get(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    encoder = _qwen25_vl(tok, {
        "text_config": {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": len(tok),
                        "bos_token_id": None,
                        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},  # head dim 16
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                          "out_hidden_size": hidden, "fullatt_block_indexes": [0]},
        "image_token_id": len(tok) if image is None else image,
        "video_token_id": vocab.get("<|video_pad|>", len(tok) + 1),
        "vision_start_token_id": len(tok) + 2 if start is None else start,
        **({} if end is None else {"vision_end_token_id": end})})
    return pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=encoder,
                    tokenizer=tok, **components, **transformers)


class QwenImage(PipelineFamily):
    name, pipeline_class, transformer_class = "qwen-image", "QwenImagePipeline", "QwenImageTransformer2DModel"
    cfg_by = "true_cfg_scale"

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import QwenImagePipeline

        from ..tokenizers import qwen_tokenizer

        return tiny_qwen_image(QwenImagePipeline, spec, transformers, qwen_tokenizer())

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLQwenImage  # its defaults are Qwen-Image's VAE

        return {"text_encoder": _qwen25_vl(pipe.tokenizer, QWEN25_VL_7B), "vae": AutoencoderKLQwenImage()}

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> None:
        return None  # the prompt's tokens after the template's prefix, unpadded

    def postprocess(self, spec: ModelSpec, pipe: Any, sample: Any) -> Any:
        return super().postprocess(spec, pipe, sample[:, :, 0])  # its VAE decodes a one-frame video


FAMILY = QwenImage()

"""Qwen-Image-Edit (`QwenImageEditPipeline`): Qwen-Image's transformer, its input image's latents packed after
the generated image's tokens (one sequence, split as one), and a Qwen2.5-VL text encoder that reads the prompt
with the image through its processor. The pipeline resizes the input image to about 1024 x 1024 for the VAE
whatever the output size, so an edit's sequence is the output's tokens plus about 4096."""
from __future__ import annotations

from typing import Any

from torch import nn

from ..configs import ModelSpec
from .qwen_image import QWEN25_VL_7B, QwenImage, _qwen25_vl, tiny_qwen_image


class QwenImageEdit(QwenImage):
    name, pipeline_class = "qwen-image-edit", "QwenImageEditPipeline"
    needs_image = True

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import QwenImageEditPipeline

        from ..tokenizers import qwen_vl_processor, qwen_vl_tokenizer

        tok = qwen_vl_tokenizer()
        pipe = tiny_qwen_image(QwenImageEditPipeline, spec, transformers, tok,
                               processor=qwen_vl_processor(tok, spec.extras.get("vl_max_pixels")))
        # the system prompt's token count in our tokenizer (the pipeline drops it by count, 64 in Qwen's)
        prefix = pipe.prompt_template_encode[:pipe.prompt_template_encode.index("<|vision_start|>")]
        pipe.prompt_template_encode_start_idx = len(tok(prefix).input_ids)
        return pipe

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLQwenImage

        vision = {"image_token_id": pipe.processor.image_token_id,
                  "video_token_id": pipe.processor.video_token_id,
                  "vision_start_token_id": pipe.tokenizer.convert_tokens_to_ids("<|vision_start|>"),
                  "vision_end_token_id": pipe.tokenizer.convert_tokens_to_ids("<|vision_end|>")}
        return {"text_encoder": _qwen25_vl(pipe.tokenizer, {**QWEN25_VL_7B, **vision}),
                "vae": AutoencoderKLQwenImage()}


FAMILY = QwenImageEdit()

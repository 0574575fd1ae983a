"""HunyuanVideo 1.5 (`HunyuanVideo15Pipeline`): a Qwen2.5-VL-7B text model (its third-to-last hidden states, after a
system turn the pipeline crops by count, 1000 text tokens), a ByT5 glyph encoder for quoted text, a 16x spatial,
4x temporal causal VAE of 32 latent channels, and a guider (ClassifierFreeGuidance) that runs the conditional and
unconditional calls one after the other.

The guider is a component, built at the model's guidance scale (`ModelSpec.guidance_scale`); a call's
`--guidance-scale` is set on it for that call, and the CFG split does not take its two calls apart.
"""
from __future__ import annotations

import functools
from itertools import count
from typing import Any

from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily
from .qwen_image import QWEN25_VL_7B

BYT5_GLYPH: dict[str, Any] = {  # text_encoder_2/config.json: Glyph-SDXL-v2's ByT5-small encoder
    "vocab_size": 1510, "d_model": 1472, "d_kv": 64, "d_ff": 3584, "num_layers": 12, "num_heads": 6,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
}


def _qwen25_vl_text(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**config, pad_token_id=tokenizer.pad_token_id,
                                                    bos_token_id=None, eos_token_id=tokenizer.eos_token_id))


def _byt5(tokenizer: Any, **config: Any) -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**config, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))


@functools.cache
def with_step_callback() -> type:
    """HunyuanVideo15Pipeline with the `callback_on_step_end` its call lacks (what the runtime agrees a step's end,
    deadline and cancel by): called after each scheduler step with the new latents, which it may replace; and, for
    the word-level tokenizer (`offline_tokenizer`), the prompt crop set to its system turn's length."""
    from diffusers import HunyuanVideo15Pipeline

    class Pipeline(HunyuanVideo15Pipeline):
        def __init__(self, text_encoder: Any, tokenizer: Any, transformer: Any, vae: Any, scheduler: Any,
                     text_encoder_2: Any, tokenizer_2: Any, guider: Any, offline_tokenizer: bool = False):
            super().__init__(text_encoder, tokenizer, transformer, vae, scheduler, text_encoder_2, tokenizer_2, guider)
            if offline_tokenizer:  # crop its own system turn, not Qwen2.5's 108 tokens (else the prompt goes too)
                turn = [[{"role": "system", "content": self.system_message}, {"role": "user", "content": ""}]]
                ids = self.tokenizer.apply_chat_template(turn, tokenize=True, return_dict=True)["input_ids"][0]
                self.prompt_template_encode_start_idx = len(ids) - 2  # less the turn's end: <|im_end|>, line break

        def __call__(self, *args: Any, callback_on_step_end: Any = None, guidance_scale: float | None = None,
                     **kwargs: Any) -> Any:
            if guidance_scale is not None:  # the guider's scale for this call (diffusers' call takes none)
                self.guider.guidance_scale = guidance_scale
            if callback_on_step_end is None:
                return super().__call__(*args, **kwargs)
            scheduler, steps = self.scheduler, count()

            def step(model_output: Any, timestep: Any, sample: Any, *rest: Any, **options: Any) -> Any:
                out = type(scheduler).step(scheduler, model_output, timestep, sample, *rest, **options)
                given = out[0] if isinstance(out, tuple) else out.prev_sample
                latents = callback_on_step_end(self, next(steps), timestep, {"latents": given})["latents"]
                if isinstance(out, tuple):
                    return (latents, *out[1:])
                out.prev_sample = latents
                return out

            scheduler.step = step
            try:
                return super().__call__(*args, **kwargs)
            finally:
                del scheduler.step

    Pipeline.__name__ = Pipeline.__qualname__ = "HunyuanVideo15Pipeline"
    return Pipeline


class HunyuanVideo15(PipelineFamily):
    name, pipeline_class = "hunyuan-video-1.5", "HunyuanVideo15Pipeline"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    cfg_by = None  # the guider's two calls, not a call argument
    diffusers_cp = False

    @property
    def pipeline(self) -> type:
        return with_step_callback()

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLHunyuanVideo15
        from transformers import ByT5Tokenizer

        from ..tokenizers import qwen_chat_tokenizer

        cfg = spec.transformer
        tok, tok2 = qwen_chat_tokenizer(spec.max_sequence_length + 108), ByT5Tokenizer()  # the prompt after the crop
        blocks = spec.vae_scale.bit_length()  # one more than the VAE's downsamplings
        vae = AutoencoderKLHunyuanVideo15(latent_channels=cfg["out_channels"], block_out_channels=(8,) * blocks,
                                          layers_per_block=1, spatial_compression_ratio=spec.vae_scale,
                                          temporal_compression_ratio=spec.temporal)
        hidden = cfg["text_embed_dim"]
        # three layers: the pipeline reads the third-to-last hidden states
        encoder = _qwen25_vl_text(tok, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=len(tok),
                                  rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # head width 16
        glyphs = _byt5(tok2, vocab_size=len(tok2), d_model=cfg["text_embed_2_dim"], d_kv=8, d_ff=32, num_layers=1,
                       num_heads=2)
        return self.pipeline(text_encoder=encoder, tokenizer=tok, vae=vae, text_encoder_2=glyphs,
                             tokenizer_2=tok2, **self.parts(spec), **transformers, **self.pipeline_kwargs(spec))

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLHunyuanVideo15  # its defaults are HunyuanVideo 1.5's VAE

        text = {k: v for k, v in QWEN25_VL_7B["text_config"].items() if k != "tie_word_embeddings"}
        return {"text_encoder": _qwen25_vl_text(pipe.tokenizer, **text),
                "text_encoder_2": _byt5(pipe.tokenizer_2, **BYT5_GLYPH), "vae": AutoencoderKLHunyuanVideo15()}

    @staticmethod
    def parts(spec: ModelSpec) -> dict[str, Any]:
        """The scheduler (flow matching, shifted by flow_shift) and the guider at the model's guidance scale."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.guiders import ClassifierFreeGuidance

        return {"scheduler": FlowMatchEulerDiscreteScheduler(shift=spec.extras.get("flow_shift", 5.0)),
                "guider": ClassifierFreeGuidance(guidance_scale=spec.guidance_scale)}

    def pipeline_kwargs(self, spec: ModelSpec) -> dict[str, Any]:
        return {"offline_tokenizer": True}  # random weights: the word-level tokenizers (real ones load theirs)

    def call_kwargs(self, spec: ModelSpec, frames: int, guidance_scale: float | None,
                    true_cfg_scale: float | None, max_sequence_length: int) -> dict[str, Any]:
        # the text length is the pipeline's own; the guidance is set on the guider for the call
        return {"num_frames": frames, **({"guidance_scale": guidance_scale} if guidance_scale is not None else {})}

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> None:
        return None  # the prompt's own tokens: the plan drops the padding before the split


FAMILY = HunyuanVideo15()

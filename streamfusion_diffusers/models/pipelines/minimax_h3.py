"""MiniMax-H3 (diffusers' modular `MiniMaxH3Blocks`, text to video with stereo sound): a Qwen3-VL text encoder (its
hidden state 50 over the prompt's own tokens, no template), one packed [text ; audio ; video] sequence through a
guidance-distilled transformer (one call per step), two schedulers (video and audio) stepped after each call, a 16x
spatial video VAE that makes 17n + 5 frames of 5n + 2 latent frames at 24 fps, and a mono audio VAE at 32 kHz that
decodes the two stereo channels as a batch of two. The video VAE decodes on one rank: its ViT decoder attends over
the whole clip in every layer and ships tiled, so no band of latent rows decodes exactly.

diffusers ships MiniMax-H3 as modular blocks only; `MiniMaxH3Pipeline` runs the text-to-video ones behind a
DiffusionPipeline's call, which is what the runtime builds, parallelizes and calls (components by name,
`encode_prompt`, `callback_on_step_end`, `.frames`), and gives the sound beside the frames. Real size, the 33B
transformer (66 GB in bfloat16) and the 27B Qwen3-VL (54 GB) do not fit one 80 GB GPU together: `encode_first`.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ..configs import ModelSpec
from .base import PipelineFamily

# MiniMaxAI/MiniMax-H3 text_encoder/config.json: Qwen3-VL-32B-Instruct's, its text stack 51 layers deep (the pipeline
# reads hidden state 50, which must not be the last, post-norm one)
QWEN3_VL_32B: dict[str, Any] = {
    "text_config": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 51,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                        "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 5120, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "deepstack_visual_indexes": [8, 16, 24], "num_position_embeddings": 2304},
    "tie_word_embeddings": False,
}
SHIFTS = {"scheduler": 12.0, "audio_scheduler": 3.0}  # the released schedules' sigma shifts, video and audio


def _qwen3_vl(processor: Any, config: dict[str, Any]) -> nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok = processor.tokenizer
    text = {**config["text_config"], "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    vision = {"image_token_id": processor.image_token_id, "video_token_id": processor.video_token_id,
              "vision_start_token_id": tok.convert_tokens_to_ids("<|vision_start|>"),
              "vision_end_token_id": tok.convert_tokens_to_ids("<|vision_end|>")}
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(**{**config, **vision, "text_config": text}))


@functools.cache
def pipeline_class() -> type:
    """MiniMaxH3Pipeline (made on first use: diffusers is imported only where a pipeline is built)."""
    from dataclasses import dataclass

    from diffusers import DiffusionPipeline, ModularPipeline
    from diffusers.modular_pipelines import ModularPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (MiniMaxH3CoreDenoiseStep,
                                                                                  MiniMaxH3DecodeStep)
    from diffusers.modular_pipelines.modular_pipeline_utils import InputParam, OutputParam
    from diffusers.utils import BaseOutput

    class StepEnd(ModularPipelineBlocks):
        """The last block of a denoising step: the call's `callback_on_step_end` with the video rows."""

        model_name = "minimax-h3"

        @property
        def description(self) -> str:
            return "Calls `callback_on_step_end` after each step with the video rows, which it may replace."

        @property
        def inputs(self) -> list[InputParam]:
            return [InputParam("callback_on_step_end"), InputParam("latents", type_hint=torch.Tensor, required=True)]

        @property
        def intermediate_outputs(self) -> list[OutputParam]:
            return [OutputParam("latents", type_hint=torch.Tensor)]

        def __call__(self, components: Any, block_state: Any, i: int, t: torch.Tensor) -> tuple[Any, Any]:
            if block_state.callback_on_step_end is not None:
                given = {"latents": block_state.latents}
                block_state.latents = block_state.callback_on_step_end(components, i, t, given)["latents"]
            return components, block_state

    denoise = MiniMaxH3CoreDenoiseStep()  # text to video: layout, noise, timesteps, the loop, the rows unpacked
    denoise.sub_blocks["denoise"].sub_blocks["step_end"] = StepEnd()
    decode = MiniMaxH3DecodeStep()

    @dataclass
    class MiniMaxH3PipelineOutput(BaseOutput):
        """frames: the videos (output_type's form; "latent": the video latents); audio: (videos, 2, samples) in
        [-1, 1] ("latent": the audio latents); sampling_rate: the audio's samples a second."""

        frames: Any
        audio: torch.Tensor
        sampling_rate: int

    class MiniMaxH3Pipeline(DiffusionPipeline):
        model_cpu_offload_seq = "text_encoder->transformer->vae->audio_vae"

        def __init__(self, transformer: Any, vae: Any, audio_vae: Any, scheduler: Any, audio_scheduler: Any,
                     text_encoder: Any, tokenizer: Any, processor: Any):
            super().__init__()
            self.register_modules(transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=scheduler,
                                  audio_scheduler=audio_scheduler, text_encoder=text_encoder, tokenizer=tokenizer,
                                  processor=processor)

        @classmethod
        def from_pretrained(cls, weights: str, torch_dtype: torch.dtype | None = None,
                            **kwargs: Any) -> MiniMaxH3Pipeline:
            """MiniMax-H3's repository (a modular one: no model_index.json) through diffusers' modular loader, the
            text-to-video components only (its reference transformer stays unloaded)."""
            modular = ModularPipeline.from_pretrained(weights, workflow="t2va", **kwargs)
            modular.load_components(dtype=torch_dtype)
            parts = modular.components
            return cls(**{name: parts[name] for name in cls._get_signature_keys(cls)[0]})

        def _modular(self, blocks: Any) -> Any:
            """A modular pipeline of `blocks` over this pipeline's components as they are now."""
            modular = blocks.init_pipeline()
            modular.update_components(**{n: c for n, c in self.components.items() if n in modular.components})
            # the layout step reads the latent geometry off the VAEs, which the denoising blocks do not name
            modular.vae, modular.audio_vae = self.vae, self.audio_vae
            modular.set_progress_bar_config(**getattr(self, "_progress_bar_config", {}))
            return modular

        def encode_prompt(self, prompt: str, device: torch.device | None = None,
                          max_sequence_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            """(prompt embeddings, each row's modality tag) of the prompt's own tokens, as MiniMax-H3's text step
            encodes them; at most max_sequence_length tokens (None: all)."""
            modular = self._modular(denoise)
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"][:max_sequence_length]
            embeds = get_qwen3vl_prompt_embeds(self.text_encoder, self.processor, ids, {}, modular.text_encoder_layer,
                                               device=device or self._execution_device, dtype=self.text_encoder.dtype)
            return embeds, torch.full((len(ids),), modular.text_tag, dtype=torch.long)

        @torch.no_grad()
        def __call__(self, prompt: str | None = None, prompt_embeds: torch.Tensor | None = None,
                     height: int | None = None, width: int | None = None, num_frames: int = 124,
                     num_inference_steps: int = 50, generator: torch.Generator | None = None,
                     output_type: str = "pil", num_videos_per_prompt: int = 1, max_sequence_length: int | None = None,
                     callback_on_step_end: Any = None, return_dict: bool = True) -> Any:
            """One video and its sound. num_inference_steps: transformer calls, as every pipeline here counts them
            (the blocks count the points of the schedule, one more); output_type "latent": no decode."""
            if not isinstance(prompt if prompt_embeds is None else "", str) or num_videos_per_prompt != 1:
                raise ValueError("MiniMax-H3 makes one video a call (one packed sequence): give one prompt, n=1")
            if prompt_embeds is None:
                prompt_embeds, tags = self.encode_prompt(prompt, max_sequence_length=max_sequence_length)
            else:
                tags = torch.full((prompt_embeds.shape[1],), self._modular(denoise).text_tag, dtype=torch.long)
            step_end = None if callback_on_step_end is None else (
                lambda _, i, t, given: callback_on_step_end(self, i, t, given))
            out = self._modular(denoise)(
                prompt_embeds=prompt_embeds, text_token_tags=tags, height=height, width=width, num_frames=num_frames,
                num_inference_steps=num_inference_steps + 1, generator=generator, callback_on_step_end=step_end,
                output=["latents", "audio_latents"])
            if output_type == "latent":
                frames, audio, rate = out["latents"], out["audio_latents"], self.audio_vae.config.sampling_rate
            else:
                decoded = self._modular(decode)(**out, output_type=output_type,
                                                output=["videos", "audio", "sampling_rate"])
                frames, audio, rate = decoded["videos"], decoded["audio"], decoded["sampling_rate"]
            self.maybe_free_model_hooks()
            if not return_dict:
                return frames, audio, rate
            return MiniMaxH3PipelineOutput(frames=frames, audio=audio, sampling_rate=rate)

    MiniMaxH3Pipeline.__module__ = __name__
    return MiniMaxH3Pipeline


class MiniMaxH3(PipelineFamily):
    name, pipeline_class, transformer_class = "minimax-h3", "MiniMaxH3Pipeline", "MiniMaxH3Transformer3DModel"
    cfg_by = None  # guidance-distilled: one call per step
    encode_first = True

    @property
    def pipeline(self) -> type:
        return pipeline_class()

    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

        from ..tokenizers import qwen3_vl_processor, qwen_vl_tokenizer

        cfg = spec.transformer
        processor = qwen3_vl_processor(qwen_vl_tokenizer())
        latent, audio_latent = cfg["in_channels"], cfg["audio_in_channels"]
        # the real VAE's 16x spatial, 17-to-5 temporal chunks, narrow; its ViT decoder one layer deep
        vae = AutoencoderKLMiniMaxH3(latent_channels=latent, block_out_channels=(8,) * 6, layers_per_block=1,
                                     norm_num_groups=2, decoder_num_layers=1, decoder_num_attention_heads=2,
                                     decoder_attention_head_dim=8, latents_mean=(0.0,) * latent,
                                     latents_std=(1.0,) * latent)
        # the real 800-sample hop at 32 kHz (40 latents a second) in three strides
        audio_vae = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=4 * audio_latent, latent_channels=audio_latent,
            num_attention_heads=2, decoder_dim=16, decoder_rates=(8, 10, 10), decoder_kernel_sizes=(16, 20, 20),
            resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),), latents_mean=[0.0] * audio_latent,
            latents_std=[1.0] * audio_latent)
        hidden = cfg["text_dim"]
        # 51 layers, as the real one: the pipeline reads hidden state 50
        encoder = _qwen3_vl(processor, {
            "text_config": {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 51,
                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": hidden // 2,
                            "vocab_size": len(processor.tokenizer),
                            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                "mrope_interleaved": True}},
            "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                              "out_hidden_size": hidden, "deepstack_visual_indexes": [0]}})
        return self.pipeline(vae=vae, audio_vae=audio_vae, text_encoder=encoder, tokenizer=processor.tokenizer,
                             processor=processor, **self.schedulers(), **transformers)

    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio  # their defaults are MiniMax-H3's

        return {"text_encoder": _qwen3_vl(pipe.processor, QWEN3_VL_32B), "vae": AutoencoderKLMiniMaxH3(),
                "audio_vae": AutoencoderKLMiniMaxH3Audio()}

    @staticmethod
    def schedulers() -> dict[str, Any]:
        from diffusers import MiniMaxH3Scheduler

        return {name: MiniMaxH3Scheduler(shift=shift) for name, shift in SHIFTS.items()}

    def call_kwargs(self, spec: ModelSpec, frames: int, guidance_scale: float | None,
                    true_cfg_scale: float | None, max_sequence_length: int) -> dict[str, Any]:
        return {"num_frames": frames, "max_sequence_length": max_sequence_length}  # no guidance: distilled

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> None:
        return None  # the prompt's own tokens, unpadded, in the one sequence

    def audio(self, pipe: Any, result: Any) -> tuple[Any, int]:
        return result.audio, result.sampling_rate


FAMILY = MiniMaxH3()

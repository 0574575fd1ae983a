"""What `streamfusion generate`, `bench --level e2e` and the builders need to know of one pipeline family.

A family is one diffusers pipeline class and the models run through it (models/configs.py MODELS names each
model's family, its sizes and token count). Each family's module says how to build its pipeline offline around
seeded random transformers (small text encoders and VAE for the CPU, real-size ones from their real configs for
timing), how it is guided, and what its call takes. Nothing else in the package branches on the family. These
modules import diffusers and transformers only where they build, so the CLI checks a job without them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from importlib import import_module
from typing import Any

from torch import nn

from ..configs import ModelSpec


class PipelineFamily(ABC):
    """One pipeline family; the subclasses in this package fill in what differs."""

    name: str
    pipeline_class: str  # diffusers' pipeline class: loads real weights (`--weights`)
    transformer_class: str  # diffusers' transformer class
    # the call argument whose value > 1 makes two transformer calls (or one of batch 2) per step; None: never
    # (guidance-distilled only)
    cfg_by: str | None = "guidance_scale"
    # real size: the text encoder and the transformer do not fit one GPU together, so the prompt is encoded
    # first, the encoder freed, and only then the transformer built
    encode_first: bool = False
    # the call arguments that `encode_prompt`'s outputs stand for, in its order, once the encoder is freed (outputs
    # past these the call makes again itself: Flux.2's text ids, MiniMax-H3's tags)
    encoded: tuple[str, ...] = ("prompt_embeds",)
    diffusers_cp: bool = True  # its transformer has diffusers' own `_cp_plan` (bench's diffusers-cp baseline)
    needs_image: bool = False  # every call edits an input image (models/configs.py ModelSpec.images: how many)

    @property
    def pipeline(self) -> type:
        return getattr(import_module("diffusers"), self.pipeline_class)

    @property
    def transformer(self) -> type[nn.Module]:
        return getattr(import_module("diffusers"), self.transformer_class)

    @abstractmethod
    def tiny(self, spec: ModelSpec, transformers: dict[str, nn.Module]) -> Any:
        """The pipeline around `transformers` with small text encoders and VAE whose sizes match what the
        transformer takes (latent channels, text width, the spec's compression). Built in the caller's default
        dtype and device."""

    @abstractmethod
    def full(self, spec: ModelSpec, pipe: Any) -> dict[str, nn.Module]:
        """The real-size text encoder(s) and VAE from their real configs, to replace `pipe`'s small ones."""

    def transformer_names(self, spec: ModelSpec) -> tuple[str, ...]:
        """The pipeline's transformer components (Wan 2.2 A14B: two experts)."""
        return ("transformer",)

    def pipeline_kwargs(self, spec: ModelSpec) -> dict[str, Any]:
        """Constructor arguments of the pipeline beyond its components (Wan's boundary_ratio, ...)."""
        return {}

    def guided(self, guidance_scale: float | None, true_cfg_scale: float | None) -> bool:
        """Whether a step makes two guidance branches (what the CFG split parallelizes)."""
        value = {"guidance_scale": guidance_scale, "true_cfg_scale": true_cfg_scale}.get(self.cfg_by or "")
        return value is not None and value > 1

    def call_kwargs(self, spec: ModelSpec, frames: int, guidance_scale: float | None,
                    true_cfg_scale: float | None, max_sequence_length: int) -> dict[str, Any]:
        """The pipeline call's arguments beyond prompt, size, steps, generator and output type."""
        kwargs: dict[str, Any] = {"max_sequence_length": max_sequence_length}
        if guidance_scale is not None:
            kwargs["guidance_scale"] = guidance_scale
        if spec.video:
            kwargs["num_frames"] = frames
        if true_cfg_scale is not None:
            kwargs.update(true_cfg_scale=true_cfg_scale, negative_prompt="")
        return kwargs

    def size_kwargs(self, height: int, width: int) -> dict[str, Any]:
        """Call arguments beyond height and width that the asked size needs to be the size made."""
        return {}

    def image_kwargs(self, spec: ModelSpec, images: list[Any]) -> dict[str, Any]:
        """The call's arguments for its input images (PIL, in order): `image=`, one or a list."""
        return {"image": images[0] if len(images) == 1 else list(images)}

    def image_refusal(self, width: int, height: int) -> str | None:
        """Why the pipeline would refuse an input image of this size (said before any rank runs), else None."""
        return None

    def image_pipeline(self, spec: ModelSpec, pipe: Any) -> Any:
        """The pipeline that takes input images: `pipe` itself unless the family has one of its own."""
        return pipe

    def joint_text(self, spec: ModelSpec, max_sequence_length: int) -> int | None:
        """Text tokens the self-attention takes besides the image (what a context-parallel plan splits with it):
        the prompt padded to max_sequence_length by default; 0 where the text enters by cross-attention only;
        None where it is the prompt's own length."""
        return max_sequence_length

    def audio(self, pipe: Any, result: Any) -> tuple[Any, int] | None:
        """The call's sound where the model makes it: its waveforms (a tensor, outputs x channels x samples, in
        [-1, 1]) and their sample rate, from rank 0's output; None for a silent model."""
        return None

    def postprocess(self, spec: ModelSpec, pipe: Any, sample: Any) -> Any:
        """A VAE decode's sample as the pipeline's output_type "pt" makes it (what bench compares outputs by)."""
        if spec.video:
            return pipe.video_processor.postprocess_video(video=sample, output_type="pt")
        return pipe.image_processor.postprocess(sample, output_type="pt")


def small_t5(hidden: int, tokenizer: Any) -> nn.Module:
    """A one-layer T5 encoder of width `hidden` (Flux.1's text_encoder_2, CogVideoX's text_encoder)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=16, d_ff=64, num_layers=1,
                                   num_heads=2, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))


T5_XXL: dict[str, Any] = {  # the encoder of google/t5-v1_1-xxl (Flux.1-dev's text_encoder_2, CogVideoX's text_encoder)
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False, "decoder_start_token_id": 0,
}


def t5_xxl(tokenizer: Any) -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**T5_XXL, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


__all__ = ["PipelineFamily", "T5_XXL", "small_t5", "t5_xxl"]

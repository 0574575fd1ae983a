"""Models and whole pipelines built offline with random weights, for tests, the demo and real-size timing runs.

No model hub is needed: transformers come from a config dict, text encoders and VAEs are small ones whose
output sizes match what the transformer expects, and tokenizers are word-level ones made here. The same
seed gives the same weights on every rank. Users with real weights load them with `load_pipeline`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

from .configs import MODELS

# Enough words for demo prompts; anything else becomes <unk>, which the random-weight encoders accept.
WORDS = ("a an the of in on at with and by under over near photo painting render portrait landscape city "
         "mountain mountains river lake sea ocean forest tree trees flower flowers sky cloud clouds sun moon star "
         "stars night day sunset sunrise snow rain fog cat dog bird horse fish robot car train boat house castle "
         "bridge street road red orange yellow green blue purple black white golden silver bright dark "
         "small large tiny huge old new beautiful detailed cinematic colorful quiet").split()

FLUX_SCHEDULER: dict[str, Any] = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096,
                                  "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                                  "use_dynamic_shifting": True}
COGVIDEOX_SCHEDULER: dict[str, Any] = {"beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                                       "clip_sample": False, "num_train_timesteps": 1000,
                                       "prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
                                       "set_alpha_to_one": True, "snr_shift_scale": 1.0, "steps_offset": 0,
                                       "timestep_spacing": "trailing"}


def word_tokenizer(specials: dict[str, str], template: str, max_length: int) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer over WORDS; `specials` maps role (unk, pad, bos, eos) to token."""
    names = list(dict.fromkeys(specials.values()))
    vocab = {token: i for i, token in enumerate(names + list(WORDS))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=specials["unk_token"]))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in names if t in template])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, **specials)


def clip_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer({"unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<|startoftext|>",
                           "eos_token": "<|endoftext|>"}, "<|startoftext|> $A <|endoftext|>", 77)


def t5_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    return word_tokenizer({"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}, "$A </s>", max_length)


@contextmanager
def _default_dtype_and_device(dtype: torch.dtype, device: torch.device | str) -> Iterator[None]:
    """Create parameters directly in their final dtype and device: a real-size model never sits in float32 on CPU."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_transformer(name_or_config: str | dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> torch.nn.Module:
    """A Flux or CogVideoX transformer from a MODELS name or a config dict, with seeded random weights."""
    if isinstance(name_or_config, str):
        family, config = MODELS[name_or_config].family, MODELS[name_or_config].transformer
    else:
        config = name_or_config
        family = "flux" if "num_single_layers" in config else "cogvideox"
    cls = FluxTransformer2DModel if family == "flux" else CogVideoXTransformer3DModel
    torch.manual_seed(seed)
    with _default_dtype_and_device(dtype, device):
        model = cls(**config)
    return model.eval()


def _flux_vae(latent_channels: int, downsamples: int) -> AutoencoderKL:
    blocks = downsamples + 1
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         block_out_channels=(8,) * blocks, layers_per_block=1, norm_num_groups=2,
                         down_block_types=("DownEncoderBlock2D",) * blocks,
                         up_block_types=("UpDecoderBlock2D",) * blocks,
                         use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)


def _clip_encoder(hidden: int, tokenizer: PreTrainedTokenizerFast) -> CLIPTextModel:
    return CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                       num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77,
                                       projection_dim=hidden, bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


def _t5_encoder(hidden: int, tokenizer: PreTrainedTokenizerFast) -> T5EncoderModel:
    return T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=hidden, d_kv=16, d_ff=64, num_layers=1,
                                   num_heads=2, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))


def build_pipeline(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> DiffusionPipeline:
    """A whole Flux or CogVideoX pipeline around MODELS[name]'s transformer, all weights random (seeded).

    Text encoders have one layer and the width the transformer takes; the VAE has the real latent channels and
    the spec's compression (8x spatial for real-size models), so token counts match a real run at that size.
    """
    spec = MODELS[name]
    cfg = spec.transformer
    transformer = build_transformer(name, seed=seed, dtype=dtype, device=device)
    torch.manual_seed(seed + 1)
    with _default_dtype_and_device(dtype, device):
        if spec.family == "flux":
            tok, tok2 = clip_tokenizer(), t5_tokenizer(spec.max_sequence_length)
            pipe = FluxPipeline(
                scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
                vae=_flux_vae(cfg["in_channels"] // 4, spec.vae_scale.bit_length() - 1),
                text_encoder=_clip_encoder(cfg["pooled_projection_dim"], tok), tokenizer=tok,
                text_encoder_2=_t5_encoder(cfg["joint_attention_dim"], tok2), tokenizer_2=tok2,
                transformer=transformer)
        else:
            tok = t5_tokenizer(spec.max_sequence_length)
            vae = AutoencoderKLCogVideoX(in_channels=3, out_channels=3, latent_channels=cfg["in_channels"],
                                         down_block_types=("CogVideoXDownBlock3D",) * 4,
                                         up_block_types=("CogVideoXUpBlock3D",) * 4,
                                         block_out_channels=(8,) * 4, layers_per_block=1, norm_num_groups=2,
                                         temporal_compression_ratio=4)
            pipe = CogVideoXPipeline(tokenizer=tok, text_encoder=_t5_encoder(cfg["text_embed_dim"], tok), vae=vae,
                                     transformer=transformer,
                                     scheduler=CogVideoXDDIMScheduler(**COGVIDEOX_SCHEDULER))
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # built in training mode: T5's dropout would make every run differ
    return pipe


def load_pipeline(name: str, weights: str, *, dtype: torch.dtype, device: torch.device | str) -> DiffusionPipeline:
    """Real weights: a hub id or a local folder in diffusers' layout (what users normally run)."""
    cls = FluxPipeline if MODELS[name].family == "flux" else CogVideoXPipeline
    return cls.from_pretrained(weights, torch_dtype=dtype).to(device)

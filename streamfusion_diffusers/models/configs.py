"""The model registry: one `ModelFamily` per family, registered at the bottom of this file, names its named
models (real and tiny, with their transformer configs), its pipeline adapter, its plan and its recipes; `--model`'s
choices, the builders (models/pipelines/) and the plan lookup (diffusers/plans/) read it. Also the transformer
configs: the real ones (FLUX.1-dev, CogVideoX-5b, FLUX.2-dev, Wan 2.2, Qwen-Image) and tiny ones for tests and the
CPU demo.

The real dicts are the `transformer/config.json` of each model's diffusers repository, written out so that a
real-size model can be built (with random weights) where no model hub is reachable. Plain data only: a family
names its adapter and plan by module, so the CLI and the layout choice read the registry without diffusers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FLUX_DEV: dict[str, Any] = {
    "attention_head_dim": 128,
    "axes_dims_rope": (16, 56, 56),
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}

COGVIDEOX_5B: dict[str, Any] = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 64,
    "dropout": 0.0,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 16,
    "max_text_seq_length": 226,
    "norm_elementwise_affine": True,
    "norm_eps": 1e-05,
    "num_attention_heads": 48,
    "num_layers": 42,
    "out_channels": 16,
    "patch_size": 2,
    "sample_frames": 49,
    "sample_height": 60,
    "sample_width": 90,
    "spatial_interpolation_scale": 1.875,
    "temporal_compression_ratio": 4,
    "temporal_interpolation_scale": 1.0,
    "text_embed_dim": 4096,
    "time_embed_dim": 512,
    "timestep_activation_fn": "silu",
    "use_rotary_positional_embeddings": True,
}

# The VAEs' `vae/config.json` of the same two models (only what differs from diffusers' defaults where it is long).
FLUX_DEV_VAE: dict[str, Any] = {
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "latent_channels": 16,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}

COGVIDEOX_5B_VAE: dict[str, Any] = {  # AutoencoderKLCogVideoX's defaults are CogVideoX's VAE; 5b scales by 0.7
    "scaling_factor": 0.7,
}

# 8 heads: enough for Ulysses over 8 ranks; one joint and one single block, so both Flux block kinds run.
TINY_FLUX: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 6, 6),
    "guidance_embeds": False,
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "num_single_layers": 1,
    "patch_size": 1,
    "pooled_projection_dim": 32,
}

# max_text_seq_length 10 divides neither 4 nor 8 ranks, like the real 226: text goes in as joint tokens.
TINY_COGVIDEOX: dict[str, Any] = {
    "attention_head_dim": 16,
    "in_channels": 4,
    "max_text_seq_length": 10,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": 2,
    "sample_frames": 9,
    "sample_height": 8,
    "sample_width": 8,
    "temporal_compression_ratio": 4,
    "text_embed_dim": 32,
    "time_embed_dim": 32,
    "use_rotary_positional_embeddings": True,
}

# Tiny configs of the newer models: 8 heads (Ulysses over 8 ranks), one block of each kind, widths of 16 per head.
TINY_FLUX2: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 4, 4, 4),
    "guidance_embeds": True,
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "num_single_layers": 1,
    "timestep_guidance_channels": 32,
}

TINY_WAN: dict[str, Any] = {
    "attention_head_dim": 16,
    "ffn_dim": 64,
    "freq_dim": 32,
    "in_channels": 4,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": (1, 2, 2),
    "rope_max_seq_len": 64,
    "text_dim": 32,
}

TINY_QWEN_IMAGE: dict[str, Any] = {
    "attention_head_dim": 16,
    "axes_dims_rope": (4, 6, 6),
    "in_channels": 16,
    "joint_attention_dim": 32,
    "num_attention_heads": 8,
    "num_layers": 1,
    "out_channels": 4,
    "patch_size": 2,
}

# The newer models' `transformer/config.json` (diffusers' layout), written out like FLUX_DEV above.
FLUX2_DEV: dict[str, Any] = {  # black-forest-labs/FLUX.2-dev, 32B
    "attention_head_dim": 128,
    "axes_dims_rope": (32, 32, 32, 32),
    "eps": 1e-06,
    "guidance_embeds": True,
    "in_channels": 128,
    "joint_attention_dim": 15360,
    "mlp_ratio": 3.0,
    "num_attention_heads": 48,
    "num_layers": 8,
    "num_single_layers": 48,
    "patch_size": 1,
    "rope_theta": 2000,
    "timestep_guidance_channels": 256,
}

_WAN22: dict[str, Any] = {"attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-06, "freq_dim": 256,
                          "patch_size": (1, 2, 2), "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
                          "text_dim": 4096}
WAN22_TI2V_5B: dict[str, Any] = {**_WAN22, "ffn_dim": 14336, "in_channels": 48, "num_attention_heads": 24,
                                 "num_layers": 30, "out_channels": 48}  # Wan-AI/Wan2.2-TI2V-5B-Diffusers
WAN22_T2V_A14B: dict[str, Any] = {**_WAN22, "ffn_dim": 13824, "in_channels": 16, "num_attention_heads": 40,
                                  "num_layers": 40, "out_channels": 16}  # each of its two experts (high/low noise)

QWEN_IMAGE: dict[str, Any] = {  # Qwen/Qwen-Image, 20B
    "attention_head_dim": 128,
    "axes_dims_rope": (16, 56, 56),
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
}

Z_IMAGE_TURBO: dict[str, Any] = {  # Tongyi-MAI/Z-Image-Turbo, 6B
    "all_f_patch_size": (1,),
    "all_patch_size": (2,),
    "axes_dims": (32, 48, 48),
    "axes_lens": (1536, 512, 512),
    "cap_feat_dim": 2560,
    "dim": 3840,
    "in_channels": 16,
    "n_heads": 30,
    "n_kv_heads": 30,
    "n_layers": 30,
    "n_refiner_layers": 2,
    "norm_eps": 1e-05,
    "qk_norm": True,
    "rope_theta": 256.0,
    "t_scale": 1000.0,
}
TINY_Z_IMAGE: dict[str, Any] = {"axes_dims": (4, 6, 6), "axes_lens": (256, 32, 32), "cap_feat_dim": 32, "dim": 128,
                                "in_channels": 4, "n_heads": 8, "n_kv_heads": 8, "n_layers": 1, "n_refiner_layers": 1}
# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v: the class defaults (8.3B), text-to-video; in_channels:
# the latents, an image condition's latents (zero here) and its mask, 2 x 32 + 1
HUNYUAN_VIDEO_15_480P: dict[str, Any] = {
    "attention_head_dim": 128,
    "image_embed_dim": 1152,
    "in_channels": 65,
    "mlp_ratio": 4.0,
    "num_attention_heads": 16,
    "num_layers": 54,
    "num_refiner_layers": 2,
    "out_channels": 32,
    "patch_size": 1,
    "patch_size_t": 1,
    "qk_norm": "rms_norm",
    "rope_axes_dim": (16, 56, 56),
    "rope_theta": 256.0,
    "target_size": 640,
    "task_type": "t2v",
    "text_embed_2_dim": 1472,
    "text_embed_dim": 3584,
}
TINY_HUNYUAN_VIDEO_15: dict[str, Any] = {"attention_head_dim": 16, "image_embed_dim": 16, "in_channels": 9,
                                         "num_attention_heads": 8, "num_layers": 1, "num_refiner_layers": 1,
                                         "out_channels": 4, "rope_axes_dim": (4, 6, 6), "task_type": "t2v",
                                         "text_embed_2_dim": 16, "text_embed_dim": 32}
# MiniMaxAI/MiniMax-H3 transformer/config.json: the class defaults (33B), one packed [text ; audio ; video] sequence
MINIMAX_H3: dict[str, Any] = {
    "attention_head_dim": 128,
    "audio_in_channels": 32,
    "ffn_dim": 14336,
    "final_norm_eps": 1e-05,
    "freq_dim": 256,
    "hidden_size": 5376,
    "in_channels": 24,
    "norm_eps": 1e-05,
    "num_attention_heads": 56,
    "num_layers": 50,
    "num_refiner_layers": 2,
    "patch_size": (1, 2, 2),
    "qk_norm_eps": 1e-05,
    "rope_freq_dim": 16,
    "rope_theta": 10000.0,
    "text_dim": 5120,
    "time_embed_dim": 2688,
    "time_embed_hidden_dim": 5376,
}
# rope_freq_dim 2: the three axes rotate 2 x 3 x 2 of a head's 16 channels
TINY_MINIMAX_H3: dict[str, Any] = {"attention_head_dim": 16, "audio_in_channels": 4, "ffn_dim": 128, "freq_dim": 32,
                                   "hidden_size": 64, "in_channels": 4, "num_attention_heads": 8, "num_layers": 1,
                                   "num_refiner_layers": 1, "rope_freq_dim": 2, "text_dim": 32, "time_embed_dim": 32,
                                   "time_embed_hidden_dim": 64}
# Lightricks/LTX-2 transformer/config.json (19B: a video stream of 32 x 128 and an audio stream of 32 x 64)
LTX2: dict[str, Any] = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 128,
    "attention_out_bias": True,
    "audio_attention_head_dim": 64,
    "audio_cross_attention_dim": 2048,
    "audio_hop_length": 160,
    "audio_in_channels": 128,
    "audio_num_attention_heads": 32,
    "audio_out_channels": 128,
    "audio_sampling_rate": 16000,
    "caption_channels": 3840,
    "causal_offset": 1,
    "cross_attention_dim": 4096,
    "in_channels": 128,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "num_attention_heads": 32,
    "num_layers": 48,
    "out_channels": 128,
    "qk_norm": "rms_norm_across_heads",
    "rope_double_precision": True,
    "rope_theta": 10000.0,
    "rope_type": "split",
    "vae_scale_factors": (8, 32, 32),
}
TINY_LTX2: dict[str, Any] = {**LTX2, "attention_head_dim": 16, "audio_attention_head_dim": 8,
                             "audio_cross_attention_dim": 64, "audio_in_channels": 8, "audio_num_attention_heads": 8,
                             "audio_out_channels": 8, "caption_channels": 32, "cross_attention_dim": 128,
                             "in_channels": 8, "num_attention_heads": 8, "num_layers": 1, "out_channels": 8}

FPS = 8  # frames a second of a video model's mp4s unless its ModelSpec says otherwise
JOINT = ("flux", "flux2", "qwen-image", "hunyuan-video")  # families whose self-attention takes the text too
EDIT = ("qwen-image-edit", "flux-kontext")  # pipeline families whose every call edits an input image


@dataclass(frozen=True)
class TransformerSpec:
    """A model run as its transformer alone (tests, `benchmarks/models_gpu.py`): its family (`inputs.FAMILIES`),
    config, and the token grid of its default output size ((rows, cols) or (frames, rows, cols)) and text length."""

    family: str
    transformer: dict[str, Any]
    grid: tuple[int, ...]
    text: int


TRANSFORMERS: dict[str, TransformerSpec] = {
    "tiny-flux2": TransformerSpec("flux2", TINY_FLUX2, (4, 4), 8),
    "flux2-dev": TransformerSpec("flux2", FLUX2_DEV, (64, 64), 512),  # 1024x1024: 16x VAE + 2x2 packing
    "tiny-wan": TransformerSpec("wan", TINY_WAN, (2, 4, 4), 8),
    "wan2.2-ti2v-5b": TransformerSpec("wan", WAN22_TI2V_5B, (31, 22, 40), 512),  # 704x1280, 121 frames
    "wan2.2-t2v-a14b": TransformerSpec("wan", WAN22_T2V_A14B, (21, 45, 80), 512),  # 720x1280, 81 frames
    "tiny-qwen-image": TransformerSpec("qwen-image", TINY_QWEN_IMAGE, (4, 4), 8),
    "qwen-image": TransformerSpec("qwen-image", QWEN_IMAGE, (83, 83), 128),  # 1328x1328
    "tiny-qwen-image-edit": TransformerSpec("qwen-image", TINY_QWEN_IMAGE, (4, 4), 8),
    "qwen-image-edit": TransformerSpec("qwen-image", QWEN_IMAGE, (64, 64), 128),  # 1024x1024, input image beside
    "tiny-flux-kontext": TransformerSpec("flux", TINY_FLUX, (4, 4), 16),
    "flux-kontext": TransformerSpec("flux", FLUX_DEV, (64, 64), 512),  # 1024x1024, input image beside
    "flux-dev": TransformerSpec("flux", FLUX_DEV, (64, 64), 512),  # 1024x1024
    "z-image-turbo": TransformerSpec("z-image", Z_IMAGE_TURBO, (64, 64), 128),  # 1024x1024, a prompt's valid tokens
    "hunyuanvideo-1.5": TransformerSpec("hunyuan-video-1.5", HUNYUAN_VIDEO_15_480P, (31, 30, 53), 256),  # 480x848, 121
    # frames; the prompt's valid tokens (its padding is dropped before the blocks)
    "ltx2": TransformerSpec("ltx2", LTX2, (16, 16, 24), 1024),  # 512x768, 121 frames (the audio's tokens follow them)
    "minimax-h3": TransformerSpec("minimax-h3", MINIMAX_H3, (37, 24, 42), 256),  # 768x1344, 124 frames, packed
    # after a prompt's tokens with their stereo sound
}


@dataclass(frozen=True)
class ModelSpec:
    """A named model: its pipeline family (`models.pipelines`), transformer config, and the defaults
    `streamfusion generate` runs it with."""

    family: str  # the name of its ModelFamily (below)
    transformer: dict[str, Any]
    height: int
    width: int
    frames: int  # 1 for image models
    steps: int
    max_sequence_length: int
    guidance_scale: float | None  # None: the model has no guidance_scale (Qwen-Image guides by true CFG only)
    vae_scale: int  # pixels per latent pixel, each side
    patch: int = 2  # latent pixels per token, each side (Flux's pipelines pack 2 x 2 latent pixels)
    temporal: int = 1  # frames per latent frame after the first (video VAEs: 4)
    extras: dict[str, Any] = field(default_factory=dict)  # the family's own settings (Wan: boundary_ratio, ...)
    images: int = 0  # input images a call takes (`generate --image`): edits' references, Flux.2's, Wan TI2V's first
    # frame; 0: none
    fps: int = FPS  # frames a second of its videos (the mp4's rate, `seconds` of serve's requests); a model that
    # makes sound makes it for frames / fps seconds
    # a video VAE that decodes overlapping chunks (MiniMax-H3's: 17 frames from 5 latent frames, the last 3 shared
    # with the next chunk): (frames, latent frames) of a chunk; frames are chunk[0] x n + chunk[1], from
    # chunk[1] x n + 2 latent frames. None: `temporal` frames per latent frame after the first
    chunk: tuple[int, int] | None = None
    # the clip lengths its pipeline makes, frames / fps seconds, both ends taken (MiniMax-H3's 5 to 15 s); None: any
    clip_seconds: tuple[float, float] | None = None

    def image_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """Image/video tokens the transformer sees at this size (the one formula): latent frames, over
        CogVideoX 1.5's temporal patch, times latent pixels over the patch size, each side."""
        latent_frames = (frames - 1) // self.temporal + 1 if self.chunk is None else \
            (frames - self.chunk[1]) // self.chunk[0] * self.chunk[1] + 2
        p_t = self.transformer.get("patch_size_t") or 1
        side = self.vae_scale * self.patch
        return (latent_frames // p_t) * (height // side) * (width // side)

    def reference_tokens(self, height: int, width: int) -> int:
        """Tokens an edit's input image adds to the split sequence, counted at the output's size (the pipelines
        pack its latents after the image's: Qwen-Image-Edit, Kontext); 0 for models that generate only."""
        return self.image_tokens(height, width) if self.family in EDIT else 0

    @property
    def attention(self) -> tuple[int, int, int]:
        """(heads, head width, blocks) of its self-attention, whichever names its config uses (Z-Image's: n_heads,
        dim, n_layers)."""
        cfg = self.transformer
        heads = cfg.get("num_attention_heads") or cfg["n_heads"]
        blocks = cfg.get("num_layers", cfg.get("n_layers", 1)) + cfg.get("num_single_layers", 0)
        return heads, cfg.get("attention_head_dim") or cfg["dim"] // heads, blocks

    def frames_refusal(self, frames: int) -> str | None:
        """Why the pipeline would not make `frames` frames as given (its video VAE would round them, or the clip
        would be shorter or longer than clip_seconds), else None."""
        per, rest = self.chunk or (self.temporal, 1)
        low, high = self.clip_frames
        if frames < rest or (frames - rest) % per:
            return f"must be {per}k + {rest} (e.g. {min(max(low, (frames - rest) // per * per + rest), high)})"
        if self.clip_seconds is not None and not low <= frames <= high:
            shortest, longest = self.clip_seconds
            return f"must be from {low} to {high} ({shortest:g} to {longest:g} s at {self.fps} fps)"
        return None

    @property
    def clip_frames(self) -> tuple[int, float]:
        """The fewest and most frames the video VAE makes within clip_seconds (no most: inf)."""
        per, rest = self.chunk or (self.temporal, 1)
        if self.clip_seconds is None:
            return rest, math.inf
        shortest, longest = (self.fps * seconds for seconds in self.clip_seconds)
        return rest + max(0, math.ceil((shortest - rest) / per)) * per, rest + math.floor((longest - rest) / per) * per

    def frames_for(self, seconds: int) -> int:
        """The fewest frames the video VAE makes that last `seconds` (fps x seconds + 1 where it makes any 4k + 1)."""
        per, rest = self.chunk or (self.temporal, 1)
        return rest - (rest - self.fps * seconds - 1) // per * per

    def seconds_of(self, frames: int) -> float:
        """How long `frames` last as serve's `seconds` count them: the whole seconds frames_for makes them for,
        else (frames - 1) / fps."""
        whole = (frames - 1) // self.fps
        return whole if whole and self.frames_for(whole) == frames else (frames - 1) / self.fps

    def seconds_range(self, max_frames: int) -> tuple[int, int]:
        """The whole seconds a request may ask for (serve's `seconds`): those whose frames_for the pipeline makes,
        at most max_frames of them ((1, 0) where none)."""
        fits = [seconds for seconds in range(1, max_frames // self.fps + 1)
                if self.frames_for(seconds) <= max_frames and self.frames_refusal(self.frames_for(seconds)) is None]
        return (fits[0], fits[-1]) if fits else (1, 0)

    @property
    def video(self) -> bool:
        """Frames out (a video VAE), else one image."""
        return self.temporal > 1

    @property
    def size_step(self) -> int:
        """Pixels a side must be a multiple of, so that the pipeline runs the size as given."""
        return self.vae_scale * self.patch


@dataclass(frozen=True)
class ModelFamily:
    """One model family: what `--model` runs through one pipeline, and what splits its transformer.

    name: the family its models' ModelSpec.family names. transformer_class: diffusers' transformer class, what the
    plan lookup matches a transformer by. models: the named models it runs (real size and tiny). tiny: each
    real-size model's tiny stand-in (the CPU's, in bench and in generate's hints). pipeline: the module of
    models/pipelines/ whose FAMILY builds and calls its pipeline (None: parallelize only, no `--model`). plan:
    the module of diffusers/plans/ whose PLAN splits its transformer (None: diffusers' own `_cp_plan`). recipes:
    its packaged recipes (choice/recipes/<name>.yaml), which method "auto" reads.
    """

    name: str
    transformer_class: str
    models: dict[str, ModelSpec] = field(default_factory=dict)
    tiny: dict[str, str] = field(default_factory=dict)
    pipeline: str | None = None
    plan: str | None = None
    recipes: tuple[str, ...] = ()


FAMILIES: dict[str, ModelFamily] = {}
MODELS: dict[str, ModelSpec] = {}  # every family's named models (what `--model` takes), filled by register_model
TINY: dict[str, str] = {}  # every real-size model's tiny counterpart, filled by register_model


def register_model(family: ModelFamily) -> ModelFamily:
    """Add a family to the registry: its models become `--model` choices, its plan the plan of its transformer
    class. A name already taken, a model of another family, a tiny stand-in it does not hold, or another plan
    for a transformer class a family already splits is one line naming the clash."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered already; pick another name")
    if family.models and family.pipeline is None:
        raise ValueError(f"model family {family.name!r} has models but no pipeline: name its models/pipelines/ "
                         f"module")
    clash = sorted(set(family.models) & set(MODELS))
    wrong = sorted(m for m, spec in family.models.items() if spec.family != family.name)
    unknown = sorted(t for t in family.tiny.values() if t not in family.models)
    other = next((f for f in FAMILIES.values() if f.transformer_class == family.transformer_class
                  and f.plan != family.plan), None)
    if clash or wrong or unknown:
        raise ValueError(f"model family {family.name!r}: " + "; ".join(
            [f"models {clash} are taken"] * bool(clash) + [f"models {wrong} name another family"] * bool(wrong)
            + [f"tiny stand-ins {unknown} are not among its models"] * bool(unknown)))
    if other is not None:
        raise ValueError(f"model family {family.name!r} splits {family.transformer_class} by plan {family.plan!r}, "
                         f"family {other.name!r} by {other.plan!r}: one plan per transformer class")
    FAMILIES[family.name] = family
    MODELS.update(family.models)
    TINY.update(family.tiny)
    return family


register_model(ModelFamily(
    "flux", "FluxTransformer2DModel", pipeline="flux", recipes=("flux-dev",),
    models={"tiny-flux": ModelSpec("flux", TINY_FLUX, 64, 64, 1, 4, 16, 3.5, vae_scale=2),
            "flux-dev": ModelSpec("flux", FLUX_DEV, 1024, 1024, 1, 28, 512, 3.5, vae_scale=8)},
    tiny={"flux-dev": "tiny-flux"}))
register_model(ModelFamily(
    "cogvideox", "CogVideoXTransformer3DModel", pipeline="cogvideox", plan="cogvideox", recipes=("cogvideox-5b",),
    models={"tiny-cogvideox": ModelSpec("cogvideox", TINY_COGVIDEOX, 64, 64, 9, 4, 10, 6.0, vae_scale=8, temporal=4),
            "cogvideox-5b": ModelSpec("cogvideox", COGVIDEOX_5B, 480, 720, 49, 50, 226, 6.0, vae_scale=8,
                                      temporal=4)},
    tiny={"cogvideox-5b": "tiny-cogvideox"}))
# Wan 2.2: TI2V-5B's own VAE compresses 16x (z_dim 48) and its timesteps are per token; A14B runs a high-noise
# expert down to boundary_ratio x 1000, then a low-noise one, on Wan 2.1's 8x VAE.
register_model(ModelFamily(
    "wan", "WanTransformer3DModel", pipeline="wan",
    models={"tiny-wan": ModelSpec("wan", TINY_WAN, 64, 64, 9, 4, 16, 5.0, vae_scale=16, temporal=4, images=1,
                                  extras={"expand_timesteps": True}),
            "wan2.2-ti2v-5b": ModelSpec("wan", WAN22_TI2V_5B, 704, 1280, 121, 50, 512, 5.0, vae_scale=16,
                                        temporal=4, images=1, extras={"expand_timesteps": True, "flow_shift": 5.0}),
            "tiny-wan-a14b": ModelSpec("wan", TINY_WAN, 64, 64, 9, 4, 16, 4.0, vae_scale=8, temporal=4,
                                       extras={"boundary_ratio": 0.875}),
            "wan2.2-t2v-a14b": ModelSpec("wan", WAN22_T2V_A14B, 720, 1280, 81, 40, 512, 4.0, vae_scale=8, temporal=4,
                                         extras={"boundary_ratio": 0.875, "flow_shift": 3.0})},
    tiny={"wan2.2-ti2v-5b": "tiny-wan", "wan2.2-t2v-a14b": "tiny-wan-a14b"}))
register_model(ModelFamily(
    "qwen-image", "QwenImageTransformer2DModel", pipeline="qwen_image", plan="qwen_image",
    models={"tiny-qwen-image": ModelSpec("qwen-image", TINY_QWEN_IMAGE, 64, 64, 1, 4, 64, None, vae_scale=8),
            "qwen-image": ModelSpec("qwen-image", QWEN_IMAGE, 1328, 1328, 1, 50, 512, None, vae_scale=8)},
    tiny={"qwen-image": "tiny-qwen-image"}))
# Edits: Qwen-Image's and Flux.1's transformers (Qwen/Qwen-Image-Edit, black-forest-labs/FLUX.1-Kontext-dev ship the
# same transformer configs); the tiny Qwen2-VL processor resizes the prompt's image to 56 x 56 pixels, the tiny
# Kontext keeps its input image's size (no resize to Kontext's trained sizes)
register_model(ModelFamily(
    "qwen-image-edit", "QwenImageTransformer2DModel", pipeline="qwen_image_edit", plan="qwen_image",
    models={"tiny-qwen-image-edit": ModelSpec("qwen-image-edit", TINY_QWEN_IMAGE, 64, 64, 1, 4, 64, None,
                                              vae_scale=8, images=1, extras={"vl_max_pixels": 56 * 56}),
            "qwen-image-edit": ModelSpec("qwen-image-edit", QWEN_IMAGE, 1024, 1024, 1, 50, 512, None, vae_scale=8,
                                         images=1)},
    tiny={"qwen-image-edit": "tiny-qwen-image-edit"}))
register_model(ModelFamily(
    "flux-kontext", "FluxTransformer2DModel", pipeline="flux_kontext",
    models={"tiny-flux-kontext": ModelSpec("flux-kontext", TINY_FLUX, 64, 64, 1, 4, 16, 2.5, vae_scale=2, images=1,
                                           extras={"auto_resize": False}),
            "flux-kontext": ModelSpec("flux-kontext", FLUX_DEV, 1024, 1024, 1, 28, 512, 2.5, vae_scale=8, images=1)},
    tiny={"flux-kontext": "tiny-flux-kontext"}))
# Flux.2 stacks three hidden layers of its text encoder: a text width divisible by 3
register_model(ModelFamily(
    "flux2", "Flux2Transformer2DModel", pipeline="flux2",
    models={"tiny-flux2": ModelSpec("flux2", {**TINY_FLUX2, "joint_attention_dim": 48}, 64, 64, 1, 4, 16, 4.0,
                                    vae_scale=4, images=10),
            "flux2-dev": ModelSpec("flux2", FLUX2_DEV, 1024, 1024, 1, 50, 512, 4.0, vae_scale=8, images=10)},
    tiny={"flux2-dev": "tiny-flux2"}))
# Transformers parallelize splits by a plan of ours that no `--model` runs (users' pipelines)
register_model(ModelFamily("hunyuan-video", "HunyuanVideoTransformer3DModel", plan="hunyuan_video"))
register_model(ModelFamily("ltx", "LTXVideoTransformer3DModel", plan="ltx"))
register_model(ModelFamily("longcat-image", "LongCatImageTransformer2DModel", plan="longcat_image"))
register_model(ModelFamily("krea2", "Krea2Transformer2DModel", plan="krea2"))
register_model(ModelFamily("cosmos3", "Cosmos3OmniTransformer", plan="cosmos3"))
# MiniMax-H3: guidance-distilled, video with stereo sound at 24 fps, 5 to 15 seconds (17n + 5 frames); 768 x 1344 its
# 16:9 canvas, 1 x 2 x 2 patches of a 16x VAE
register_model(ModelFamily(
    "minimax-h3", "MiniMaxH3Transformer3DModel", pipeline="minimax_h3", plan="minimax_h3",
    models={"tiny-minimax-h3": ModelSpec("minimax-h3", TINY_MINIMAX_H3, 64, 64, 124, 4, 1024, None, vae_scale=16,
                                         temporal=4, fps=24, chunk=(17, 5), clip_seconds=(5.0, 15.0)),
            "minimax-h3": ModelSpec("minimax-h3", MINIMAX_H3, 768, 1344, 124, 50, 1024, None, vae_scale=16,
                                    temporal=4, fps=24, chunk=(17, 5), clip_seconds=(5.0, 15.0))},
    tiny={"minimax-h3": "tiny-minimax-h3"}))
# LTX-2: 32x spatial, 8x temporal VAE, 1 x 1 patches, 24 fps (its sound spans the frames); the diffusers example's
# 512 x 768, 121 frames, 30 steps, guidance 3
register_model(ModelFamily(
    "ltx2", "LTX2VideoTransformer3DModel", pipeline="ltx2", plan="ltx2",
    models={"tiny-ltx2": ModelSpec("ltx2", TINY_LTX2, 64, 64, 25, 4, 16, 3.0, vae_scale=32, patch=1, temporal=8,
                                   fps=24),
            "ltx2": ModelSpec("ltx2", LTX2, 512, 768, 121, 30, 1024, 3.0, vae_scale=32, patch=1, temporal=8, fps=24)},
    tiny={"ltx2": "tiny-ltx2"}))
# Z-Image-Turbo: distilled (guidance 0), 9 scheduler steps (8 transformer calls), latents unpacked (in_channels
# the VAE's) and patched 2 x 2 by the transformer
register_model(ModelFamily(
    "z-image", "ZImageTransformer2DModel", pipeline="z_image", plan="z_image",
    models={"tiny-z-image": ModelSpec("z-image", TINY_Z_IMAGE, 64, 64, 1, 4, 16, 0.0, vae_scale=2),
            "z-image-turbo": ModelSpec("z-image", Z_IMAGE_TURBO, 1024, 1024, 1, 9, 512, 0.0, vae_scale=8)},
    tiny={"z-image-turbo": "tiny-z-image"}))
# HunyuanVideo 1.5: 16x spatial, 4x temporal VAE, 1 x 1 patches; 1000 text tokens (the pipeline's own length)
register_model(ModelFamily(
    "hunyuan-video-1.5", "HunyuanVideo15Transformer3DModel", pipeline="hunyuan_video15", plan="hunyuan_video15",
    models={"tiny-hunyuanvideo-1.5": ModelSpec("hunyuan-video-1.5", TINY_HUNYUAN_VIDEO_15, 64, 64, 9, 4, 1000, 6.0,
                                               vae_scale=16, patch=1, temporal=4),
            "hunyuanvideo-1.5": ModelSpec("hunyuan-video-1.5", HUNYUAN_VIDEO_15_480P, 480, 848, 121, 50, 1000, 6.0,
                                          vae_scale=16, patch=1, temporal=4, extras={"flow_shift": 5.0})},
    tiny={"hunyuanvideo-1.5": "tiny-hunyuanvideo-1.5"}))

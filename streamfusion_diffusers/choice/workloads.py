"""The workloads the project plans for: token counts and shapes of real-size models, and the transformer config
the block and step levels build for each.

Shapes follow the models' real diffusers configs: Flux.1-dev (19 joint + 38 single blocks, 24 heads of 128,
512 text tokens, 2x2-patched latents at 1/8 of the pixels) and CogVideoX-5b (42 blocks, 48 heads of 64,
226 text tokens, latents at 1/8 of the pixels and (frames - 1) / 4 + 1 latent frames, 2x2 patches); the newer
models (Flux.2-dev, Qwen-Image, Wan 2.2 TI2V-5B and T2V-A14B) from their specs in models/configs.py.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..models import configs


@dataclass(frozen=True)
class Workload:
    """One denoising step's attention shape: image/video tokens (split over ranks) and text (joint) tokens."""

    name: str
    tokens: int
    text_tokens: int
    heads: int
    head_dim: int
    blocks: int
    batch: int = 1
    mlp_ratio: float = 4.0
    model: str | None = None  # its real-size transformer in models.MODELS (None: an attention shape only)
    # Flux, Flux.2, Qwen-Image: (token rows, token cols); CogVideoX: (latent frames, latent H, latent W); Wan:
    # (latent frames, token rows, token cols)
    grid: tuple[int, ...] = ()
    size: tuple[int, int, int] = ()  # its model's (frames, height, width) in pixels

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def block_flops_per_token(self) -> float:
        """Projection + MLP FLOPs a token costs in one block: 2 x (4 h^2 attention + 2 r h^2 MLP weights)."""
        return 2.0 * (4 + 2 * self.mlp_ratio) * self.hidden**2


def flux(resolution: int = 1024, height: int | None = None) -> Workload:
    height = height or resolution
    for side in (resolution, height):
        if side % 16:
            raise ValueError(f"Flux needs sides divisible by 16 pixels, got {resolution}x{height}")
    spec = configs.MODELS["flux-dev"]
    return Workload(f"flux-dev {resolution}x{height}", spec.image_tokens(height, resolution), 512, 24, 128, 57,
                    model="flux-dev", grid=(height // 16, resolution // 16), size=(1, height, resolution))


# The size the recipes, `plan` and `bench` plan CogVideoX-5b for: 768 x 1360 frames (CogVideoX 1.5's size, the
# larger sequence). CogVideoX-5b's own size, what `generate --model cogvideox-5b` runs, is 480 x 720 (its config's
# sample_height / sample_width 60 x 90 latent pixels, models/configs.py); pass it as cogvideox-5b:49:480:720.
COGVIDEOX_PLAN_HEIGHT, COGVIDEOX_PLAN_WIDTH = 768, 1360


def cogvideox(frames: int = 49, height: int = COGVIDEOX_PLAN_HEIGHT, width: int = COGVIDEOX_PLAN_WIDTH) -> Workload:
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"CogVideoX needs frames = 4k + 1 and sides divisible by 16, got {frames} at {height}x{width}")
    latent_frames = (frames - 1) // 4 + 1
    return Workload(f"cogvideox-5b {frames}f {height}x{width}",
                    configs.MODELS["cogvideox-5b"].image_tokens(height, width, frames), 226, 48, 64, 42,
                    model="cogvideox-5b", grid=(latent_frames, height // 8, width // 8), size=(frames, height, width))


def image_workload(model: str, width: int | None = None, height: int | None = None) -> Workload:
    """One step of a newer real-size image model (flux2-dev, qwen-image; an edit's input image counted at the
    output's size) at WIDTH[xHEIGHT] (square when only
    WIDTH is given), else at `streamfusion generate`'s default size."""
    spec = configs.MODELS[model]
    return _pipeline_workload(model, 1, height or width or spec.height, width or spec.width)


def video_workload(model: str, frames: int | None = None, height: int | None = None,
                   width: int | None = None) -> Workload:
    """One step of a Wan 2.2 model at FRAMES[, HEIGHT, WIDTH], else at `streamfusion generate`'s default."""
    spec = configs.MODELS[model]
    return _pipeline_workload(model, frames or spec.frames, height or spec.height, width or spec.width)


def _pipeline_workload(model: str, frames: int, height: int, width: int) -> Workload:
    """Joint text tokens: the ones the model's self-attention takes (none for Wan: its text enters by
    cross-attention), as many as models.configs TRANSFORMERS says."""
    spec, t = configs.MODELS[model], configs.TRANSFORMERS[model]
    step = spec.size_step
    if height % step or width % step or (frames - 1) % spec.temporal:
        raise ValueError(f"{model} needs sides divisible by {step} pixels"
                         f"{f' and frames = {spec.temporal}k + 1' if spec.video else ''}, got "
                         f"{f'{frames} frames at ' if spec.video else ''}{height}x{width}")
    cfg = spec.transformer
    side, hidden = spec.vae_scale * spec.patch, cfg["num_attention_heads"] * cfg["attention_head_dim"]
    grid = (height // side, width // side)
    return Workload(f"{model} {f'{frames}f ' if spec.video else ''}{width}x{height}",
                    spec.image_tokens(height, width, frames) + spec.reference_tokens(height, width),
                    t.text if t.family in configs.JOINT else 0,
                    cfg["num_attention_heads"], cfg["attention_head_dim"],
                    cfg["num_layers"] + cfg.get("num_single_layers", 0),
                    mlp_ratio=cfg.get("mlp_ratio", cfg.get("ffn_dim", 4 * hidden) / hidden), model=model,
                    grid=((frames - 1) // spec.temporal + 1, *grid) if spec.video else grid,
                    size=(frames, height, width))


MODELS = {"flux-dev": flux, "cogvideox-5b": cogvideox, "flux2-dev": partial(image_workload, "flux2-dev"),
          "qwen-image": partial(image_workload, "qwen-image"),
          "qwen-image-edit": partial(image_workload, "qwen-image-edit"),
          "flux-kontext": partial(image_workload, "flux-kontext"),
          "wan2.2-ti2v-5b": partial(video_workload, "wan2.2-ti2v-5b"),
          "wan2.2-t2v-a14b": partial(video_workload, "wan2.2-t2v-a14b")}


def parse_workload(spec: str) -> Workload:
    name, *params = spec.split(":")
    try:
        values = [int(p) for p in params]
    except ValueError:
        raise ValueError(f"workload {spec!r}: the numbers after the model name must be integers") from None
    if name == "custom" and len(values) == 4:
        tokens, text, heads, head_dim = values
        return Workload(f"custom {tokens}+{text}", tokens, text, heads, head_dim, blocks=1)
    if name in MODELS and len(values) <= len(inspect.signature(MODELS[name]).parameters):
        return MODELS[name](*values)
    raise ValueError(f"workload {spec!r}: use flux-dev:WIDTH[:HEIGHT] (also flux2-dev, qwen-image), "
                     f"cogvideox-5b:FRAMES[:HEIGHT:WIDTH] (also wan2.2-ti2v-5b, wan2.2-t2v-a14b) or "
                     f"custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM")


def workload_specs(text: str) -> list[str]:
    """The comma-separated workloads of --workloads; a bare size repeats the model before it, so that
    flux-dev:1024,2048 means flux-dev:1024,flux-dev:2048."""
    specs: list[str] = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        specs.append(f"{specs[-1].split(':')[0]}:{spec}" if spec[0].isdigit() and specs else spec)
    return specs


def transformer_config(w: Workload, size: str) -> dict[str, Any]:
    """The real or tiny ("real", "tiny") diffusers config of the workload's model; for custom workloads
    (attention shapes only) a tiny Flux with the workload's heads and head size, whatever the size."""
    if w.model is not None:
        return configs.MODELS[w.model if size == "real" else configs.TINY[w.model]].transformer
    side = 2 * (3 * w.head_dim // 16)  # Flux's rotary split of a head over (text, row, col) positions
    if w.head_dim % 2 or side == 0:
        raise ValueError(f"custom workloads at block/step level need an even head dim of at least 6, "
                         f"got {w.head_dim}")
    return {**configs.TINY_FLUX, "num_attention_heads": w.heads, "attention_head_dim": w.head_dim,
            "axes_dims_rope": (w.head_dim - 2 * side, side, side)}


def is_flux(config: dict[str, Any]) -> bool:
    return "num_single_layers" in config

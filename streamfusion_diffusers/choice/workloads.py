"""The workloads the project plans for: token counts and shapes of real-size models, and the transformer config
the block and step levels build for each.

Shapes follow the models' real diffusers configs: Flux.1-dev (19 joint + 38 single blocks, 24 heads of 128,
512 text tokens, 2x2-patched latents at 1/8 of the pixels) and CogVideoX-5b (42 blocks, 48 heads of 64,
226 text tokens, latents at 1/8 of the pixels and (frames - 1) / 4 + 1 latent frames, 2x2 patches).
"""
from __future__ import annotations

from dataclasses import dataclass
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
    grid: tuple[int, ...] = ()  # Flux: (token rows, token cols); CogVideoX: (latent frames, latent H, latent W)

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
    return Workload(f"flux-dev {resolution}x{height}", (resolution // 16) * (height // 16), 512, 24, 128, 57,
                    model="flux-dev", grid=(height // 16, resolution // 16))


def cogvideox(frames: int = 49, height: int = 768, width: int = 1360) -> Workload:
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"CogVideoX needs frames = 4k + 1 and sides divisible by 16, got {frames} at {height}x{width}")
    latent_frames = (frames - 1) // 4 + 1
    return Workload(f"cogvideox-5b {frames}f {height}x{width}", latent_frames * (height // 16) * (width // 16),
                    226, 48, 64, 42, model="cogvideox-5b", grid=(latent_frames, height // 8, width // 8))


MODELS = {"flux-dev": flux, "cogvideox-5b": cogvideox}


def transformer_config(w: Workload, size: str) -> dict[str, Any]:
    """The real or tiny ("real", "tiny") diffusers config of the workload's model; for custom workloads
    (attention shapes only) a tiny Flux with the workload's heads and head size, whatever the size."""
    if w.model is not None:
        spec = configs.MODELS[w.model]
        return spec.transformer if size == "real" else configs.MODELS["tiny-" + spec.family].transformer
    side = 2 * (3 * w.head_dim // 16)  # Flux's rotary split of a head over (text, row, col) positions
    if w.head_dim % 2 or side == 0:
        raise ValueError(f"custom workloads at block/step level need an even head dim of at least 6, "
                         f"got {w.head_dim}")
    return {**configs.TINY_FLUX, "num_attention_heads": w.heads, "attention_head_dim": w.head_dim,
            "axes_dims_rope": (w.head_dim - 2 * side, side, side)}


def is_flux(config: dict[str, Any]) -> bool:
    return "num_single_layers" in config

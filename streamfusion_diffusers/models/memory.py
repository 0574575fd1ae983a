"""Per-GPU memory of a model's generation at a size and cluster shape, with and without sharded weights.

What a rank holds at its peak, counted from the real configs built on the meta device (no memory, no weights): the
pipeline's weights as `streamfusion generate` holds them (transformers, text encoders, VAE; Flux.2-dev unsharded
encodes its prompt first and frees the encoder before the transformer is built), each whole or, sharded
(`parallelize(..., shard_weights=True)`), as `choose_split` splits it within a memory target: 1/P of the streamed
blocks, the kept ones and the root whole, and the two slots the streamed blocks are gathered into; then one block's
activations for this rank's share of the tokens, the attention's transfer buffers (queries, keys, values sent and
received), and the VAE decode's peak for this rank's band of rows (measured per pixel). The activation terms are
estimates (a few live tensors per block), checked against the measured one-GPU peaks (BENCHMARKS.md, "Planning
memory").
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..diffusers.weight_split import PartSizes, choose_split, part_sizes, streamed_blocks
from .configs import MODELS, ModelSpec
from .pipelines import family_of

GIB = 2**30
GPUS_GB = (24, 40, 48, 80, 141)  # the GPU memory sizes `plan --memory` checks (GB as sold: 10^9 bytes)
RUNTIME_GIB = 2.0  # CUDA context, NCCL buffers and allocator slack beside what torch allocates (not in the peaks)
BLOCK_LIVE = 4.0  # live tensors of a block's width beside its MLP's (input, normed input, attention output, residual)
ATTENTION_BUFFERS = 6.0  # Q, K, V of the local tokens, sent and received by the all-to-all (ring: K, V in flight)
# The VAE decode's peak per output pixel (per pixel of one frame for video), bf16, measured on one H200
# (BENCHMARKS.md, "VAE decode of the newer models"): Flux.2's VAE 9.7 GiB at 2048^2 (Flux.1's is the same
# architecture), Qwen-Image's 7.2 GiB at 1328^2, Wan 2.1's 10.2 GiB at 49 x 720 x 1280 (Wan 2.2's 11.5 GiB at
# 49 x 704 x 1280); CogVideoX's is not measured: Wan's figure stands in. The edit models decode with their base's VAE,
# Z-Image with Flux.1's; HunyuanVideo 1.5's and MiniMax-H3's are not measured: Wan's figure stands in.
VAE_BYTES_PER_PIXEL = {"flux": 2.5e3, "flux-kontext": 2.5e3, "flux2": 2.5e3, "z-image": 2.5e3, "qwen-image": 4.4e3,
                       "qwen-image-edit": 4.4e3, "wan": 12e3, "cogvideox": 12e3,
                       "hunyuan-video-1.5": 12e3, "minimax-h3": 12e3, "ltx2": 12e3}


@dataclass(frozen=True)
class Estimate:
    """One rank's peak, in GiB, by part; `fits` names the GPU sizes it fits with RUNTIME_GIB beside it. Sharded:
    `split` says which blocks stream, `received` the GiB of weights a rank receives per step for them and, for
    blocks run tensor-parallel, `tokens` the GiB of token rows (their all-reduces)."""

    model: str
    size: str
    ranks: int
    cfg: int
    sharded: bool
    weights: float
    gathered: float
    activations: float
    attention: float
    vae_decode: float
    text_encoder: float
    split: str = ""
    received: float = 0.0
    tokens: float = 0.0
    streams: bool = False  # sharded: some block streams (False: the split keeps every part whole)

    @property
    def peak(self) -> float:
        denoise = self.weights + self.gathered + self.activations + self.attention
        return max(denoise, self.text_encoder, self.weights + self.vae_decode)

    @property
    def fits(self) -> tuple[int, ...]:
        return tuple(gb for gb in GPUS_GB if self.peak + RUNTIME_GIB <= gb * 1e9 / GIB)

    def as_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak, "fits_gb": list(self.fits)}


def pipeline_parts(model: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, PartSizes]:
    """Parameter bytes of each module of MODELS[model]'s pipeline as generate builds it, on the meta device (made
    once per process: a real-size pipeline's meta build takes seconds, and a server's start asks several times)."""
    return dict(_parts(model, dtype))


@functools.cache
def _parts(model: str, dtype: torch.dtype) -> tuple[tuple[str, PartSizes], ...]:
    from .build import build_pipeline
    from .full import build_full_pipeline

    build = build_pipeline if model.startswith("tiny-") else build_full_pipeline
    pipe = build(model, dtype=dtype, device="meta")
    return tuple((name, part_sizes(c)) for name, c in pipe.components.items() if isinstance(c, nn.Module))


def shardable(parts: dict[str, PartSizes]) -> dict[str, PartSizes]:
    """The parts `shard_weights=True` shards: the transformers and text encoders."""
    return {n: p for n, p in parts.items() if n.startswith(("transformer", "text_encoder"))}


def unsharded(parts: dict[str, PartSizes]) -> int:
    """Bytes of the parts every rank holds whole beside the shardable ones: the VAE, and where the pipeline has
    them its audio VAE, vocoder and text connectors (LTX-2's)."""
    return sum(p.total for n, p in parts.items() if n not in shardable(parts))


def weight_budget(max_memory_gib: float, activations_gib: float, vae: int, vae_decode_gib: float) -> int:
    """Bytes per rank the sharded parts' weights may hold within `max_memory_gib`: what is left beside the
    runtime's RUNTIME_GIB, the parts held whole (`vae`: `unsharded`), and the larger of a step's activations and the
    VAE decode's peak."""
    return int((max_memory_gib - RUNTIME_GIB - max(activations_gib, vae_decode_gib)) * GIB) - vae


def estimate(model: str, height: int, width: int, frames: int, ranks: int, *, cfg: int = 1, sharded: bool = False,
             parts: dict[str, PartSizes] | None = None, bytes_per_value: int = 2,
             max_memory: float | None = None, streamed: str = "gather") -> Estimate:
    """One rank's peak memory for MODELS[model] at height x width (x frames) on `ranks` GPUs (cfg: the CFG split's
    degree), bf16 unless bytes_per_value says otherwise. Sharded, the split `shard_weights=True` takes within
    `max_memory` GiB per GPU (None: every block streams), its streamed blocks run as `streamed` says (a
    tensor-parallel block holds every token, with 1/P of the MLP's features)."""
    spec: ModelSpec = MODELS[model]
    family = family_of(model)
    parts = parts or pipeline_parts(model)
    experts = [n for n in parts if n.startswith("transformer")]
    encoders = [n for n in parts if n.startswith("text_encoder")]
    cfg_t = spec.transformer
    heads, head_dim, _ = spec.attention
    hidden = heads * head_dim
    mlp = cfg_t.get("mlp_ratio", cfg_t.get("ffn_dim", 8 / 3 * hidden if "dim" in cfg_t else 4 * hidden) / hidden)  # Z-Image: 8/3
    batch = 2 if family.name == "cogvideox" and cfg == 1 and (spec.guidance_scale or 0) > 1 else 1
    text = family.joint_text(spec, spec.max_sequence_length) or 0
    image = spec.image_tokens(height, width, frames) + spec.reference_tokens(height, width)  # an edit's input too
    tokens = batch * (math.ceil(image / (ranks // cfg)) + text)
    activations = tokens * hidden * (BLOCK_LIVE + 2 * mlp) * bytes_per_value
    attention = tokens * hidden * ATTENTION_BUFFERS * bytes_per_value if ranks // cfg > 1 else 0
    rows = math.ceil(height / ranks) if ranks > 1 else height
    vae = rows * width * VAE_BYTES_PER_PIXEL[family.name] * bytes_per_value / 2
    size = f"{frames}x{height}x{width}" if spec.video else f"{height}x{width}"
    held_whole = unsharded(parts)
    tensor_ranks = ranks // cfg  # one forward's ranks: a guidance branch's
    tensor = [n for n in experts if parts[n].sliced and len(experts) == 1] \
        if streamed == "tensor" and sharded and tensor_ranks > 1 else []
    if tensor:
        whole_tokens = batch * (image + text)
        activations = max(activations, whole_tokens * hidden * (BLOCK_LIVE + 2 * mlp / tensor_ranks) * bytes_per_value)
    if sharded and ranks > 1:
        sizes = shardable(parts)
        budget = None if max_memory is None else weight_budget(max_memory, (activations + attention) / GIB,
                                                               held_whole, vae / GIB)
        split = choose_split(sizes, ranks, budget, tensor, tensor_ranks)
        held = split.held - split.slots + held_whole
        rows = sum(image_sets * image + text_sets * text for n in split.tensor
                   for image_sets, text_sets in (sizes[n].summed[i]
                                                 for i in streamed_blocks(len(sizes[n].blocks), split.keep[n])))
        moved = rows * batch * hidden * bytes_per_value * 2 * (tensor_ranks - 1) / tensor_ranks  # ring all-reduces
        return Estimate(model, size, ranks, cfg, True, held / GIB, split.slots / GIB, activations / GIB,
                        attention / GIB, vae / GIB, (split.held + held_whole) / GIB, split.describe(sizes),
                        split.received / GIB, moved / GIB, bool(split.keep))
    total = lambda names: sum(parts[n].total for n in names)  # noqa: E731
    encode_first = family.encode_first and not model.startswith("tiny-")
    weights = total(experts) + held_whole + (0 if encode_first else total(encoders))
    encoder_peak = (total(encoders) + held_whole + (0 if encode_first else total(experts))) if encoders else 0.0
    return Estimate(model, size, ranks, cfg, False, weights / GIB, 0.0, activations / GIB, attention / GIB,
                    vae / GIB, encoder_peak / GIB)


def streamed_choice(model: str, height: int, width: int, frames: int, ranks: int, *, cfg: int = 1,
                    parts: dict[str, PartSizes] | None = None, max_memory: float | None = None) -> str:
    """How a sharded run's streamed blocks move fewer bytes a step at this size: "tensor" (their token rows, the
    all-reduces of tensor-parallel blocks) or "gather" (their weights). A model that cannot run tensor-parallel
    moves the same either way: "gather"."""
    size = (model, height, width, frames, ranks)
    parts = parts or pipeline_parts(model)
    gathered = estimate(*size, cfg=cfg, sharded=True, parts=parts, max_memory=max_memory)
    tensor = estimate(*size, cfg=cfg, sharded=True, parts=parts, max_memory=max_memory, streamed="tensor")
    return "tensor" if tensor.received + tensor.tokens < gathered.received else "gather"


def parked_gib(model: str, height: int, width: int, frames: int, ranks: int, local_ranks: int, gpu_gib: float, *,
               cfg: int = 1, parts: dict[str, PartSizes] | None = None) -> float:
    """Host memory, GiB, that a sharded job's random weights take on one machine while it starts: each of its
    `local_ranks` makes the whole pipeline and parks it in host memory before sharding it (runtime/build.py); 0
    where the split keeps every part whole on GPUs of `gpu_gib` (nothing is sharded, nothing parked)."""
    parts = parts or pipeline_parts(model)
    e = estimate(model, height, width, frames, ranks, cfg=cfg, sharded=True, parts=parts, max_memory=gpu_gib)
    return local_ranks * sum(p.total for p in parts.values()) / GIB if e.streams else 0.0


def largest_size(model: str, ranks: int, gpu_gib: float, *, frames: int | None = None, cfg: int = 1,
                 sharded: bool = False, streamed: str = "gather", dtype: torch.dtype = torch.bfloat16,
                 runtime_gib: float = RUNTIME_GIB) -> tuple[int, int]:
    """(the most pixels of a square image, the most frames at the model's own size) whose peak in `dtype` fits a
    GPU of `gpu_gib` beside `runtime_gib` on each of `ranks` ranks: what a server admits by default (sharded, its
    streamed blocks run as `streamed` says: "tensor", the larger activations of blocks that hold every token). On
    the CPU `gpu_gib` is a rank's share of the host's memory, with no CUDA runtime beside it. (0, 0) where even
    the smallest does not fit; frames 0 for image models."""
    spec = MODELS[model]
    parts = pipeline_parts(model, dtype)
    room = gpu_gib - runtime_gib

    def fits(height: int, width: int, frames: int) -> bool:
        return estimate(model, height, width, frames, ranks, cfg=cfg, sharded=sharded, parts=parts,
                        bytes_per_value=dtype.itemsize, streamed=streamed).peak <= room

    at = frames or spec.frames
    low, high = 0, 16384 // spec.size_step  # the side in size steps: the largest that fits, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * spec.size_step, mid * spec.size_step, at) else (low, mid - 1)
    side = low * spec.size_step
    most_frames = 0
    if spec.video:
        k = 0
        while k < 1024 and fits(spec.height, spec.width, spec.temporal * (k + 1) + 1):
            k += 1
        most_frames = spec.temporal * k + 1 if fits(spec.height, spec.width, spec.temporal * k + 1) else 0
    return side * side, most_frames


__all__ = ["GPUS_GB", "Estimate", "RUNTIME_GIB", "estimate", "largest_size", "parked_gib", "pipeline_parts",
           "shardable", "streamed_choice", "unsharded", "weight_budget"]

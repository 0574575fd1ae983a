"""Shared pieces of the transformer tests: tiny-model cases and the per-rank worker that checks one of them.

Every rank builds the same seeded model and inputs, runs it unparallelized (the reference) and then
parallelized, and reports the relative error together with what it saw inside the model (the tokens its
first block held, the processors installed), so a test fails if the sharding or the processors were not
really in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from diffusers import FluxPipeline
from diffusers.models.embeddings import get_3d_rotary_pos_embed

from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.core.exactness import MODEL_THRESHOLD, relative_error
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.core.sequence import split_sizes
from streamfusion_diffusers.models import TINY_COGVIDEOX, TINY_FLUX
from streamfusion_diffusers.models.build import build_transformer

TOL = MODEL_THRESHOLD[torch.float32]  # relative, a float32 model against the unparallelized one
METHODS = ("ulysses", "ring", "usp", "tas", "torus")
GROUPS = GroupCache()  # this worker's process groups, shared by its contexts
_contexts: dict[ParallelConfig, Any] = {}


@dataclass(frozen=True)
class Case:
    """One model and input shape. Flux: grid = (token rows, token cols); CogVideoX: (latent frames, H, W)."""

    family: str
    grid: tuple[int, ...]
    text: int
    batch: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        return {**(TINY_FLUX if self.family == "flux" else TINY_COGVIDEOX), **self.overrides}

    @property
    def image_tokens(self) -> int:
        if self.family == "flux":
            return self.grid[0] * self.grid[1]
        frames, height, width = self.grid
        p, p_t = self.config["patch_size"], self.config.get("patch_size_t")
        return frames // (p_t or 1) * (height // p) * (width // p)

    def inputs(self, seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        cfg, b = self.config, self.batch
        if self.family == "flux":
            rows, cols = self.grid
            return {"hidden_states": torch.randn(b, rows * cols, cfg["in_channels"], generator=g),
                    "encoder_hidden_states": torch.randn(b, self.text, cfg["joint_attention_dim"], generator=g),
                    "pooled_projections": torch.randn(b, cfg["pooled_projection_dim"], generator=g),
                    "timestep": torch.rand(b, generator=g),
                    "img_ids": FluxPipeline._prepare_latent_image_ids(b, rows, cols, "cpu", torch.float32),
                    "txt_ids": torch.zeros(self.text, 3)}
        frames, height, width = self.grid
        p = cfg["patch_size"]
        inputs = {"hidden_states": torch.randn(b, frames, cfg["in_channels"], height, width, generator=g),
                  "encoder_hidden_states": torch.randn(b, self.text, cfg["text_embed_dim"], generator=g),
                  "timestep": torch.randint(0, 1000, (b,), generator=g)}
        if cfg.get("use_rotary_positional_embeddings"):
            grid = (height // p, width // p)
            steps = frames // (cfg.get("patch_size_t") or 1)
            inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(cfg["attention_head_dim"], ((0, 0), grid), grid,
                                                                 steps)
        return inputs


FLUX_CASES = {
    "text-sharded-uneven-image": Case("flux", (6, 5), text=8),
    "text-joint-batch2": Case("flux", (8, 8), text=7, batch=2),
}
COGVIDEOX_CASES = {
    "rope-text-joint": Case("cogvideox", (3, 8, 8), text=10),
    "sincos-text-sharded-uneven": Case("cogvideox", (2, 6, 10), text=16,
                                       overrides={"use_rotary_positional_embeddings": False,
                                                  "max_text_seq_length": 16}),
    "v1.5-patch-t": Case("cogvideox", (4, 8, 8), text=10, overrides={"patch_size_t": 2}),
}


def context(config: ParallelConfig):
    """One context per config per worker, reused across tests; they share their process groups."""
    if config not in _contexts:
        _contexts[config] = init_parallel(config, groups=GROUPS)
    return _contexts[config]


def run_case(config: ParallelConfig, case: Case, seed: int) -> dict[str, Any]:
    """On every rank: the parallelized model's error against the unparallelized one, and what it held."""
    model = build_transformer(case.config, seed=seed)
    inputs = case.inputs(seed + 1)
    seen: list[int] = []
    block = model.transformer_blocks[0]  # its attention sees this rank's image tokens once the plan cut them
    (block.attn1 if hasattr(block, "attn1") else block.attn).register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    with torch.no_grad():
        reference = model(**inputs).sample
        parallelize(model, context(config))
        processors = {(type(p).__name__, getattr(getattr(p, "_attention_backend", None), "value", None))
                      for p in model.attn_processors.values()}
        out = model(**inputs).sample
        unparallelize(model)
        restored = model(**inputs).sample
    return {"error": relative_error(out, reference),
            "restored_error": relative_error(restored, reference),
            "block_tokens": seen[1], "expected_tokens": split_sizes(case.image_tokens, dist.get_world_size()),
            "processors": processors, "rank": dist.get_rank()}


def check(pool, config: ParallelConfig, case: Case, seed: int = 0) -> None:
    # Flux: the twin of its stock processor (RoPE in one pass), routed to our attention backend; CogVideoX: our
    # adapter (its stock one calls SDPA)
    expected_processor = (("FluxRotaryAttnProcessor", "streamfusion") if case.family == "flux"
                          else ("CogVideoXSPAttnProcessor", None))
    for res in pool.run(run_case, config, case, seed):
        assert res["processors"] == {expected_processor}, res
        assert res["block_tokens"] == res["expected_tokens"][res["rank"]], res
        assert res["error"] <= TOL, res
        assert res["restored_error"] == 0.0, res


def expect_error(config: ParallelConfig, case: Case) -> str:
    """On every rank: the message of the ValueError that parallelize or the first forward raises."""
    model = build_transformer(case.config)
    try:
        parallelize(model, context(config))
        with torch.no_grad():
            model(**case.inputs(0))
    except ValueError as err:
        return str(err)
    return "no error"


def refuse_foreign_processors(config: ParallelConfig) -> str:
    """On every rank: the error parallelize gives a CogVideoX running a non-stock processor, which it would lose."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = build_transformer(COGVIDEOX_CASES["rope-text-joint"].config)
    model.set_attn_processor(AttnProcessor2_0())
    try:
        parallelize(model, context(config))
    except ValueError as err:
        return str(err)
    return "no error"

"""Tiny models of every plan family and the per-rank worker that checks one through `parallelize`.

Every rank builds the same seeded model and inputs, runs it unparallelized (the reference), then parallelized,
and reports the relative error with what it saw: the tokens its first block held, and how many attention calls
`sp_attention` computed (so a case fails if the split or the routing was not really in place).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import streamfusion_diffusers.diffusers.processors.base as processors_base
from streamfusion_diffusers import ParallelConfig, init_parallel, parallelize, unparallelize
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.core.sequence import split_sizes
from streamfusion_diffusers.diffusers.routing import processors_of
from streamfusion_diffusers.models import TINY_FLUX, TINY_FLUX2, TINY_QWEN_IMAGE, TINY_WAN
from streamfusion_diffusers.models.configs import JOINT
from streamfusion_diffusers.models.inputs import build, inputs

TOL = 1e-4
TINY_LTX = {"in_channels": 8, "out_channels": 8, "num_attention_heads": 8, "attention_head_dim": 16,
            "cross_attention_dim": 128, "num_layers": 1, "caption_channels": 32}
TINY_HUNYUAN = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 8, "attention_head_dim": 16,
                "num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1, "patch_size": 2,
                "text_embed_dim": 32, "pooled_projection_dim": 16, "rope_axes_dim": (4, 6, 6)}
TINY_HELIOS = {**{k: v for k, v in TINY_WAN.items() if k != "rope_max_seq_len"}, "rope_dim": (4, 6, 6),
               "num_layers": 40}  # its plan names 40 blocks
TINY_LONGCAT_IMAGE = {"in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                      "num_attention_heads": 8, "joint_attention_dim": 32, "pooled_projection_dim": 32,
                      "axes_dims_rope": [4, 6, 6]}
TINY_KREA2 = {"in_channels": 8, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 8,
              "num_key_value_heads": 4, "intermediate_size": 128, "timestep_embed_dim": 32, "text_hidden_dim": 32,
              "num_text_layers": 3, "text_num_attention_heads": 2, "text_num_key_value_heads": 2,
              "text_intermediate_size": 64, "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1,
              "axes_dims_rope": (4, 6, 6)}
TINY_Z_IMAGE = {"in_channels": 4, "dim": 128, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 8, "n_kv_heads": 8,
                "cap_feat_dim": 32, "axes_dims": [4, 6, 6], "axes_lens": [256, 32, 32], "siglip_feat_dim": 16}
TINY_HUNYUAN_15 = {"in_channels": 4, "out_channels": 4, "num_attention_heads": 8, "attention_head_dim": 16,
                   "num_layers": 2, "num_refiner_layers": 1, "patch_size": 2, "text_embed_dim": 32,
                   "text_embed_2_dim": 16, "image_embed_dim": 16, "rope_axes_dim": (4, 6, 6)}
TINY_LTX2 = {**TINY_LTX, "audio_in_channels": 8, "audio_out_channels": 8, "audio_num_attention_heads": 8,
             "audio_attention_head_dim": 8, "audio_cross_attention_dim": 64, "rope_type": "split",  # [B, H, N, D/2]
             "gated_attn": True, "audio_gated_attn": True, "cross_attn_mod": True, "audio_cross_attn_mod": True,
             "perturbed_attn": True, "use_prompt_embeddings": False}  # LTX-2.3's blocks
TINY_MINIMAX_H3 = {"num_attention_heads": 8, "attention_head_dim": 16, "hidden_size": 64, "num_layers": 2,
                   "num_refiner_layers": 1, "ffn_dim": 128, "in_channels": 4, "audio_in_channels": 8,
                   "patch_size": (1, 2, 2), "text_dim": 32, "freq_dim": 32, "time_embed_hidden_dim": 64,
                   "time_embed_dim": 32, "rope_freq_dim": 2}
TINY_COSMOS3 = {"hidden_size": 64, "head_dim": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
                "intermediate_size": 128, "num_hidden_layers": 2, "latent_channel": 4, "patch_latent_dim": 16,
                "rope_axes_dim": (4, 2, 2), "vocab_size": 64, "sound_gen": True, "sound_dim": 8,
                "action_gen": True, "action_dim": 6, "num_embodiment_domains": 2,
                "qk_norm_for_text": False, "use_und_k_norm_for_gen": True}  # the text keys normed apart for gen
CONFIGS = {"flux": TINY_FLUX, "flux2": TINY_FLUX2, "wan": TINY_WAN, "qwen-image": TINY_QWEN_IMAGE, "ltx": TINY_LTX,
           "hunyuan-video": TINY_HUNYUAN, "chronoedit": TINY_WAN, "helios": TINY_HELIOS,
           "ltx2": TINY_LTX2,
           "minimax-h3": TINY_MINIMAX_H3,
           "cosmos3": TINY_COSMOS3,
           "longcat-image": TINY_LONGCAT_IMAGE, "krea2": TINY_KREA2, "z-image": TINY_Z_IMAGE,
           "hunyuan-video-1.5": TINY_HUNYUAN_15}
SPLIT_TEXT = (*JOINT, "longcat-image", "hunyuan-video-1.5")  # attention over [text ; image], the text split too
WHOLE_TEXT = ("krea2",)  # the text whole on every rank at any length, attended as joint rows
ONE_STREAM = {"z-image": 32}  # image and text padded to a multiple of this, then split as one sequence
GLYPHS = {"hunyuan-video-1.5": 2}  # the valid ByT5 tokens the forward packs into the text (inputs.py)
PACKED = ("minimax-h3",)  # text, audio and video packed into one split sequence, a position id a row
OMNI = ("cosmos3",)  # the text whole, then video, sound and action tokens split as one stream
_contexts: dict[ParallelConfig, Any] = {}


@dataclass(frozen=True)
class Case:
    """A family and its latent grid: (rows, cols) for images, (frames, rows, cols) for videos, in tokens."""

    family: str
    grid: tuple[int, ...]
    text: int
    batch: int = 1
    padded_text: int = 0  # trailing text tokens masked out in the last batch row (key-mask cases)
    token_timesteps: bool = False  # one timestep per latent token (Wan 2.2 TI2V)
    references: tuple[tuple[int, int], ...] = ()  # input images' token grids, after the image's tokens
    audio: int = 0  # audio tokens: LTX-2's, whole on every rank; MiniMax-H3's, in its split sequence (0: inputs')

    def rows(self, world: int) -> tuple[list[int], int]:
        """Every rank's rows of the split self-attention, and the joint rows each holds in full."""
        if self.family in PACKED:  # every row of the packed sequence, as the inputs lay it
            return split_sizes(len(self.inputs(0)["position_ids"]), world), 0
        if self.family in OMNI:  # every row after the text, as the inputs lay them
            return split_sizes(self.inputs(0)["sequence_length"] - self.text, world), self.text
        if self.family in ONE_STREAM:  # each piece padded; omni mode's: captions, latents, SigLIP (none: padding)
            multiple = ONE_STREAM[self.family]
            refs = [rows * cols for rows, cols in self.references]
            pieces = ([self.text] * (len(refs) + 2) + refs + [self.image_tokens - sum(refs)] + refs + [multiple]
                      if refs else [self.image_tokens, self.text])
            return split_sizes(sum(-(-n // multiple) * multiple for n in pieces), world), 0
        joint = self.family in WHOLE_TEXT or (self.family in SPLIT_TEXT and self.text < world)
        text = split_sizes(self.text + GLYPHS.get(self.family, 0) if self.family in SPLIT_TEXT and not joint else 0,
                           world)
        return [i + t for i, t in zip(split_sizes(self.image_tokens, world), text)], self.text if joint else 0

    @property
    def image_tokens(self) -> int:
        """The split sequence's image tokens: the image's and every input image's."""
        n = 1
        for side in self.grid:
            n *= side
        return n + sum(rows * cols for rows, cols in self.references)

    def model(self, seed: int) -> torch.nn.Module:
        return build(self.family, CONFIGS[self.family], seed=seed)

    def inputs(self, seed: int) -> dict[str, Any]:
        return inputs(self.family, CONFIGS[self.family], self.grid, self.text, batch=self.batch,
                      padded_text=self.padded_text, token_timesteps=self.token_timesteps,
                      references=self.references, audio=self.audio, seed=seed)


def context(config: ParallelConfig):
    """One context per config per worker, reused across tests (contexts build process groups)."""
    if config not in _contexts:
        _contexts[config] = init_parallel(config)
    return _contexts[config]


def run_case(config: ParallelConfig, case: Case, seed: int) -> dict[str, Any]:
    """On every rank: the parallelized model's error against the unparallelized one, and what it held."""
    model, inputs = case.model(seed), case.inputs(seed + 1)
    calls: list[tuple[int, list[int], int]] = []  # each sp_attention call: (local rows, every rank's, joint rows)

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        joint = kwargs.get("joint_q")
        calls.append((q.shape[1], list(kwargs["seq_lens"]), 0 if joint is None else joint.shape[1]))
        return real(q, *args, **kwargs)

    real, processors_base.sp_attention = processors_base.sp_attention, spy
    try:
        with torch.no_grad():
            reference = _outputs(model(**inputs, return_dict=False))
            parallelize(model, context(config))
            processors = sorted({type(p).__name__ for p in processors_of(model).values()})
            out = _outputs(model(**inputs, return_dict=False))
            unparallelize(model)
            restored = _outputs(model(**inputs, return_dict=False))
    finally:
        processors_base.sp_attention = real
    return {"error": max(relative_error(o, r) for o, r in zip(out, reference, strict=True)),
            "restored_error": max(relative_error(o, r) for o, r in zip(restored, reference, strict=True)),
            "calls": calls, "rank": dist.get_rank(), "world": dist.get_world_size(), "processors": processors}


def _outputs(result: tuple) -> list[torch.Tensor]:
    """Every output of a forward (LTX-2's video and audio), each compared; Z-Image's, one sample per batch row in a
    list, stacked."""
    return [torch.stack(x) if isinstance(x, list) else x for x in result]


def check(pool, config: ParallelConfig, case: Case, seed: int = 0, wait_s: float | None = None
          ) -> list[dict[str, Any]]:
    """Every rank's result, asserted; `wait_s`: given up on (RankFailure) past it rather than the pool's wait."""
    results = pool.run_within(pool.wait_s if wait_s is None else wait_s, run_case, config, case, seed)
    for res in results:
        split, joint = case.rows(res["world"])  # a text shorter than the ranks stays whole
        expected = (split[res["rank"]], split, joint)
        assert res["calls"], res  # the attention really ours
        assert all(tuple(call) == expected for call in res["calls"]), (expected, res)  # really split
        assert res["error"] <= TOL, res
        assert res["restored_error"] == 0.0, res
    return results


def expect_error(config: ParallelConfig, case: Case) -> str:
    """On every rank: the message of the ValueError that parallelize or the first forward raises."""
    model = case.model(0)
    try:
        parallelize(model, context(config))
        with torch.no_grad():
            model(**case.inputs(1), return_dict=False)
    except ValueError as err:
        return str(err)
    finally:
        if getattr(model, "_streamfusion", None) is not None:
            unparallelize(model)
    return "no error"


def wan_pipeline_vae(config: ParallelConfig) -> dict[str, Any]:
    """On every rank: parallelize a Wan pipeline (its VAE causal 3D); how the VAE decodes, and its decode's
    relative difference to the untouched one."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False]).eval()
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=Case("wan", (2, 3, 3), text=7).model(0),
                       vae=vae, scheduler=FlowMatchEulerDiscreteScheduler())
    z = torch.randn(1, 4, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = pipe.vae.decode(z).sample
        parallelize(pipe, context(config))
        after = pipe.vae.decode(z).sample
    mode = pipe.transformer._streamfusion.vae_decode
    unparallelize(pipe)
    return {"vae_decode": mode, "rel": relative_error(after, before)}

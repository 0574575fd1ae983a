"""The per-rank worker of the xDiT adapter tests: a tiny transformer fed the way xfuser feeds it.

xfuser cuts the batch by CFG branch, the image tokens (Flux) or the latent rows of every frame (CogVideoX) by
SP rank, and the text by SP rank when its length divides the SP degree (else every rank keeps it whole). This
worker cuts the same inputs the same way, runs the transformer with our processors installed by the adapter's
own `install` over a context spanning each SP group, and compares its slice with the unparallelized model.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from model_cases import Case

from streamfusion_diffusers import init_parallel
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.xdit.install import install, uninstall
from streamfusion_diffusers.xdit.layout import XDiTJob, parallel_config

GROUPS = GroupCache()  # this worker's process groups, shared by its contexts
_contexts: dict[Any, Any] = {}
MODELS = {"flux": "FluxTransformer2DModel", "cogvideox": "CogVideoXTransformer3DModel"}


def sp_worlds(world: int, cfg: int) -> tuple[tuple[int, ...], ...]:
    """xfuser's SP groups ("tp-sp-pp-cfg-dp" order, SP innermost): blocks of adjacent ranks, one per CFG branch."""
    sp = world // cfg
    return tuple(tuple(range(c * sp, (c + 1) * sp)) for c in range(cfg))


def _cut(x: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    return torch.chunk(x, parts, dim=dim)[index]


def xfuser_inputs(case: Case, inputs: dict[str, Any], cfg: int, cfg_rank: int, sp: int, sp_rank: int
                  ) -> dict[str, Any]:
    """This rank's inputs as xfuser's pipeline and transformer wrapper hand them to the diffusers model."""
    split = case.text % sp == 0
    out = dict(inputs)
    for name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"):
        if name in out:
            out[name] = _cut(out[name], cfg, cfg_rank, 0)
    if split:
        out["encoder_hidden_states"] = _cut(out["encoder_hidden_states"], sp, sp_rank, 1)
    if case.family == "flux":
        out["hidden_states"] = _cut(out["hidden_states"], sp, sp_rank, 1)
        out["img_ids"] = _cut(out["img_ids"], sp, sp_rank, 0)
        if split:
            out["txt_ids"] = _cut(out["txt_ids"], sp, sp_rank, 0)
        return out
    frames, height, width = case.grid
    p = case.config["patch_size"]
    out["hidden_states"] = _cut(out["hidden_states"], sp, sp_rank, 3)  # latent rows of every frame
    rows = height // p // sp  # token rows per rank
    band = slice(sp_rank * rows * (width // p), (sp_rank + 1) * rows * (width // p))
    out["image_rotary_emb"] = tuple(t.reshape(frames, -1, t.shape[-1])[:, band].reshape(-1, t.shape[-1])
                                    for t in inputs["image_rotary_emb"])
    return out


def run(case: Case, method: str, machines: int, cfg: int, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """On every rank: the relative error of this rank's output slice against the unparallelized model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    worlds = sp_worlds(world, cfg)
    sp, cfg_rank, sp_rank = world // cfg, rank // (world // cfg), rank % (world // cfg)
    job = XDiTJob(model=MODELS[case.family], sp_worlds=worlds, world_size=world,
                  ulysses=overrides.pop("xfuser_ulysses", sp), ring=overrides.pop("xfuser_ring", 1))
    config = parallel_config(job, method, machines, "torch", **overrides)
    key = (config, worlds)
    if key not in _contexts:
        _contexts[key] = init_parallel(config, worlds=worlds, groups=GROUPS)
    ctx = _contexts[key]
    model = build_transformer(case.config, seed=seed)
    inputs = case.inputs(seed + 1)
    with torch.no_grad():
        reference = model(**inputs).sample
        originals = [m.processor for m in model.modules() if hasattr(m, "processor")]
        install(model, ctx, lambda: case.text % sp == 0)
        out = model(**xfuser_inputs(case, inputs, cfg, cfg_rank, sp, sp_rank)).sample
        uninstall(model)
        restored = [m.processor for m in model.modules() if hasattr(m, "processor")]
    expected = _cut(reference, cfg, cfg_rank, 0)
    expected = _cut(expected, sp, sp_rank, 1 if case.family == "flux" else 3)
    return {"error": relative_error(out, expected), "shape": tuple(out.shape),
            "expected_shape": tuple(expected.shape), "layout": str(ctx.layout(case.config["num_attention_heads"])),
            "restored": all(a is b for a, b in zip(originals, restored)) and len(originals) == len(restored),
            "chosen": sorted(c.why for c in ctx.chosen.values()), "rank": rank}


class Delegating(torch.nn.Module):
    """An attention module behind a wrapper that forwards unknown attributes to it, as xfuser's layer wrappers do."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def restore_through_wrapper(case: Case) -> dict[str, bool]:
    """On every rank: install and uninstall on a transformer whose attention modules sit behind Delegating."""
    model = build_transformer(case.config)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    for block in blocks:
        block.attn = Delegating(block.attn)
    world = dist.get_world_size()
    job = XDiTJob(model=MODELS[case.family], sp_worlds=sp_worlds(world, 1), world_size=world, ulysses=world)
    ctx = init_parallel(parallel_config(job, "ulysses", 1, "torch"), worlds=job.sp_worlds)
    install(model, ctx, lambda: False)
    ours_installed = all(type(b.attn.processor).__name__ == "XDiTFluxAttnProcessor" for b in blocks)
    uninstall(model)
    return {"own_after": any("processor" in vars(b.attn) for b in blocks), "ours_installed": ours_installed,
            "same_after": all(b.attn.processor is b.attn.module.processor for b in blocks)}

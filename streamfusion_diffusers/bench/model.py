"""One transformer block and one denoising step, timed for every method and layout beside the no-comm bound.

The levels above one attention layer, as a diffusers user runs them. Every rank builds the same transformer
from its diffusers config with seeded random weights, and the same inputs; the unparallelized forward over the
whole sequence is the reference. Each case then sets the model up its own way (`set_up`): ours through
`parallelize`, diffusers' context parallelism ("diffusers-cp") through `enable_parallelism`, the bound through
`parallelize` with a processor that keeps every rank's work and drops every transfer. One checked forward
records the inputs of the timed blocks, which the block level then replays on this rank's tokens:

- block: Flux's first joint block then its first single block, as one timed pair (Flux.1-dev runs 19 + 38 of
  them); CogVideoX's first block;
- step: the whole `transformer(...)` call, inputs whole, cut and gathered as `parallelize` does.

The newer models (Flux.2, Qwen-Image, Wan; `models/inputs.py` builds them and their inputs) run the step level
only, without the bound: both go through the Flux and CogVideoX processors (PROCESSOR_FAMILIES).

Both are checked against the reference by relative error (the bound, which attends random keys, is not).
Over an emulated link, a row of ours also has its link bound: its attention layers' (a block's, or every block of
the step), a lower bound that leaves out the step's own split and gather; "x bound" is against the larger bound.
diffusers-cp's collectives pay the same emulated link there, so the rows compare like with like.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from diffusers import CogVideoXTransformer3DModel, ContextParallelConfig, FluxPipeline, FluxTransformer2DModel
from diffusers.hooks import HookRegistry
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.models.transformers.transformer_flux import _get_qkv_projections
from torch import Tensor
from tqdm import tqdm

from .. import init_parallel
from ..backends.emulated import EmulatedNic
from ..choice.workloads import Workload, is_flux
from ..commands.timing import Stats, deadline, interleaved_ms
from ..core.links import parse_link
from ..core.mesh import GroupCache
from ..core.sequence import split_sizes
from ..diffusers.parallel_pipeline import parallelize, unparallelize
from ..diffusers.plans import plan_for
from ..diffusers.processors import CogVideoXSPAttnProcessor, FluxSPAttnProcessor, ShardState, TokenLayout
from ..diffusers.processors.flux import flux_output, rotary_qkv
from ..diffusers.sharding import GATHER_HOOK
from ..models import MODELS, TRANSFORMERS
from ..models.build import build_transformer
from ..models.inputs import build as plan_build, inputs as plan_inputs
from .bound import link_bound_ms, local_attention, over_bounds
from .emulated_cp import over_emulated_link
from .layer import Case, Setup, device_of_job, parallel_config
from .variants import LEVELS as VARIANT_LEVELS, compiled, parallelize_options

LEVELS = ("block", "step")
PROCESSOR_FAMILIES = ("flux", "cogvideox")  # block level and bound: through our processors of these families


def family(w: Workload) -> str:
    """The workload's model family (custom workloads: a tiny Flux)."""
    return MODELS[w.model].family if w.model else "flux"


@dataclass(frozen=True)
class ModelSetup:
    """A layer-level Setup plus the transformer config to build and the levels to time."""

    setup: Setup
    config: dict[str, Any]
    levels: tuple[str, ...]


def model_inputs(w: Workload, config: dict[str, Any], seed: int, dtype: torch.dtype,
                 device: torch.device) -> dict[str, Any]:
    """The transformer's keyword arguments for one step, shaped as diffusers' pipelines pass them (with
    return_dict=False, which diffusers' context-parallel hooks need)."""
    if family(w) not in PROCESSOR_FAMILIES:  # the newer models: their cross-attention text as long as the spec's
        return {**plan_inputs(family(w), config, w.grid, TRANSFORMERS[w.model].text, batch=w.batch, seed=seed,
                              dtype=dtype, device=device), "return_dict": False}
    g = torch.Generator(device=device).manual_seed(seed)
    b = w.batch

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    if is_flux(config):
        rows, cols = w.grid or (1, w.tokens)
        inputs = {"hidden_states": randn(b, rows * cols, config["in_channels"]),
                  "encoder_hidden_states": randn(b, w.text_tokens, config["joint_attention_dim"]),
                  "pooled_projections": randn(b, config["pooled_projection_dim"]),
                  "timestep": torch.full((b,), 0.5, device=device, dtype=dtype),
                  "img_ids": FluxPipeline._prepare_latent_image_ids(b, rows, cols, device, dtype),
                  "txt_ids": torch.zeros(w.text_tokens, 3, device=device, dtype=dtype), "return_dict": False}
        if config.get("guidance_embeds"):
            inputs["guidance"] = torch.full((b,), 3.5, device=device, dtype=torch.float32)
        return inputs
    frames, height, width = w.grid
    p = config["patch_size"]
    inputs = {"hidden_states": randn(b, frames, config["in_channels"], height, width),
              "encoder_hidden_states": randn(b, w.text_tokens, config["text_embed_dim"]),
              "timestep": torch.full((b,), 500, device=device, dtype=torch.long), "return_dict": False}
    if config.get("use_rotary_positional_embeddings"):
        grid = (height // p, width // p)
        inputs["image_rotary_emb"] = get_3d_rotary_pos_embed(config["attention_head_dim"], ((0, 0), grid), grid,
                                                             frames, device=device)
    return inputs


def _local(query: Tensor, state: ShardState) -> Tensor:
    """The bound's attention: this rank's query rows against keys/values of the whole sequence's length that
    already lie here, through the fastest kernel without LSE (bound.py), so the rank does its full share of
    attention work and moves nothing. Replicated text rows are attended on every rank, as they arrive. A custom
    op, as our attention is, so a compiled bound compiles the same graphs as ours."""
    layout = state.layout
    return local_attention(query, layout.joint + sum(layout.seq_lens)).to(query.dtype)


class FluxBoundProcessor(FluxSPAttnProcessor):
    """FluxSPAttnProcessor's call with the no-communication attention in place of the backend's."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
        q, _, _ = rotary_qkv(attn, _get_qkv_projections(attn, hidden_states, encoder_hidden_states), image_rotary_emb)
        return flux_output(attn, _local(q, self.state).flatten(2, 3), encoder_hidden_states)


class CogVideoXBoundProcessor(CogVideoXSPAttnProcessor):
    """CogVideoXSPAttnProcessor's call with the no-communication attention in place of `sp_attention`."""

    def __call__(self, attn: torch.nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor,
                 attention_mask: Tensor | None = None, image_rotary_emb: tuple[Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
        query, _, _ = self.project(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        return self.output(attn, _local(query, self.state), encoder_hidden_states.size(1))


@contextmanager
def set_up(model: torch.nn.Module, case: Case, setup: Setup, groups: GroupCache
            ) -> Iterator[tuple[ShardState | None, Any]]:
    """The model run the case's way; yields the shard state our processors read and our context (both None for
    diffusers-cp, which `enable_parallelism` leaves in place for good: the caller builds a fresh model for each
    such case)."""
    if case.method == "diffusers-cp":
        if setup.dtype in (torch.float16, torch.bfloat16):
            model.set_attention_backend("_native_cudnn")  # diffusers' native SDPA has no LSE for the ring
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=case.ulysses, ring_degree=case.ring))
        link = nullcontext()
        if setup.emulate_link is not None:  # its collectives pay the emulated link as ours do
            device = next(model.parameters()).device
            link = over_emulated_link(EmulatedNic(parse_link(setup.emulate_link), setup.gpus_per_machine,
                                                  dist.get_rank(), device))
        with link:
            yield None, None
        return
    bound = case.method == "bound"
    ctx = init_parallel(parallel_config(Case("ring") if bound else case, setup), groups=groups)
    parallelize(model, ctx, **parallelize_options(case.variant))
    state: ShardState = model._streamfusion.state
    if bound:
        cls = FluxBoundProcessor if isinstance(model, FluxTransformer2DModel) else CogVideoXBoundProcessor
        model.set_attn_processor(cls(ctx, state))
        gathered = plan_for(model).gather_module
        HookRegistry.check_if_exists_or_initialize(model.get_submodule(gathered)).remove_hook(
            GATHER_HOOK.format(gathered), recurse=False)
    try:
        with compiled(model, case.variant):
            yield state, None if bound else ctx
    finally:
        unparallelize(model)


@dataclass
class _Forward:
    """One checked forward: the output, the timed blocks with their keyword inputs, and the token layout."""

    sample: Tensor
    blocks: list[tuple[torch.nn.Module, dict[str, Any]]]
    layout: TokenLayout | None


def _timed_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    if isinstance(model, FluxTransformer2DModel):
        return [model.transformer_blocks[0], model.single_transformer_blocks[0]]
    if isinstance(model, CogVideoXTransformer3DModel):
        return [model.transformer_blocks[0]]
    return []  # the newer models: step level only


def _forward(model: torch.nn.Module, inputs: dict[str, Any], state: ShardState | None) -> _Forward:
    """model(**inputs), recording the timed blocks' inputs and the layout our split hook set for them."""
    calls: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    layouts: list[TokenLayout | None] = []

    def record(module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        calls.append((module, dict(kwargs)))
        layouts.append(state.layout if state is not None else None)

    handles = [b.register_forward_pre_hook(record, with_kwargs=True) for b in _timed_blocks(model)]
    try:
        sample = model(**inputs)[0]
    finally:
        for handle in handles:
            handle.remove()
    return _Forward(sample, calls, layouts[0] if layouts else None)


def _run_blocks(run: _Forward, state: ShardState | None) -> list[tuple[Tensor, Tensor]]:
    if state is not None:
        state.layout = run.layout  # what our processors read inside the forward
    return [block(**kwargs) for block, kwargs in run.blocks]


def _block_error(outs: list[tuple[Tensor, Tensor]], refs: list[tuple[Tensor, Tensor]], layout: TokenLayout,
                 text_first: bool) -> float:
    """Relative error of this rank's block outputs against its rows of the unparallelized outputs."""
    diff = norm = 0.0
    for out, ref in zip(outs, refs):
        order = (0, 1) if text_first else (1, 0)
        for i, (start, stop) in zip(order, (layout.text_range, layout.image_range)):
            expected = ref[i][:, start:stop].float()
            diff += (out[i].float() - expected).square().sum().item()
            norm += expected.square().sum().item()
    return math.sqrt(diff / norm)


@dataclass
class _Reference:
    """The unparallelized model's inputs, output and timed blocks' outputs that every case is checked against."""

    inputs: dict[str, Any]
    sample: Tensor
    blocks: list[tuple[Tensor, Tensor]]
    even: TokenLayout  # this rank's tokens under diffusers' context parallelism (equal slices, text split too)


def _build(setup: ModelSetup, device: torch.device) -> torch.nn.Module:
    base = setup.setup
    if family(base.workload) not in PROCESSOR_FAMILIES:
        return plan_build(family(base.workload), setup.config, seed=base.seed, dtype=base.dtype, device=device)
    return build_transformer(setup.config, seed=base.seed, dtype=base.dtype, device=device)


def _reference(model: torch.nn.Module, setup: ModelSetup, device: torch.device) -> _Reference:
    w = setup.setup.workload
    inputs = model_inputs(w, setup.config, setup.setup.seed + 1, setup.setup.dtype, device)
    run = _forward(model, inputs, None)
    even = TokenLayout(dist.get_rank(), w.text_tokens, True, tuple(split_sizes(w.tokens, dist.get_world_size())))
    return _Reference(inputs, run.sample, _run_blocks(run, None), even)


def _attention_layers(model: torch.nn.Module, config: dict[str, Any]) -> dict[str, int]:
    """Attention layers per level: the timed blocks' (a Flux pair is two), the whole transformer's."""
    return {"block": len(_timed_blocks(model)),
            "step": config.get("num_layers", 0) + config.get("num_single_layers", 0)}


def _bench_case(model: torch.nn.Module, case: Case, setup: ModelSetup, ref: _Reference, device: torch.device,
                groups: GroupCache) -> tuple[dict[str, Stats], list[float], dict[str, float | None]]:
    """One case: set up, one checked forward and block replay, then each level timed. Returns the slowest
    rank's min / median / max per level (repetitions in a row: each case reconfigures the model), its
    (block, step) errors (zeros for the bound, which attends random keys) and its link bound per level."""
    base = setup.setup
    with set_up(model, case, base, groups) as (state, ctx):
        run = _forward(model, ref.inputs, state)
        outs = _run_blocks(run, state)
        errors = [0.0, 0.0]
        if case.method != "bound":
            errors = [_block_error(outs, ref.blocks, run.layout or ref.even, is_flux(setup.config)) if outs else 0.0,
                      _relative(run.sample, ref.sample)]
        del outs
        calls = {"block": lambda: _run_blocks(run, state), "step": lambda: model(**ref.inputs)}
        ms = {level: interleaved_ms([calls[level]], base.iters, base.warmup, device)[0] for level in setup.levels
              if level in VARIANT_LEVELS[case.variant]}
        w = replace(base.workload, heads=setup.config["num_attention_heads"],
                    head_dim=setup.config["attention_head_dim"])
        links = {level: link_bound_ms(ctx, w, base.dtype.itemsize, layers)
                 for level, layers in _attention_layers(model, setup.config).items()}
    return ms, errors, links


def bench_model(setup: ModelSetup, cases: list[Case], groups: GroupCache | None = None) -> list[dict]:
    """Run on every rank; one row per case and level (times: slowest rank's min / median / max; errors and peak memory:
    the largest rank's). groups: the job's process groups, reused across workloads. A bound case for a model
    outside PROCESSOR_FAMILIES is refused before the build: set_up has no bound processor for it and removes one
    gathered output (`ModelPlan.gather_module`), where MiniMax-H3 gathers two."""
    w = setup.setup.workload
    if family(w) not in PROCESSOR_FAMILIES and any(c.method == "bound" for c in cases):
        raise ValueError(f"{w.name}: the no-comm bound swaps in the Flux.1 or CogVideoX processor and drops that "
                         f"model's one gathered output, and {family(w)} has neither: time it without Case('bound')")
    device, base, groups = device_of_job(), setup.setup, groups or GroupCache()
    with deadline(base.timeout_s), torch.no_grad():
        model = _build(setup, device)
        ref = _reference(model, setup, device)
    bound_ms: dict[tuple[str, str], float] = {}  # (level, variant): each variant is compared with its own bound
    table: dict[str, list[dict]] = {level: [] for level in setup.levels}
    # diffusers-cp last: each of its cases takes a fresh model, after the one the others share is dropped
    ordered = sorted(cases, key=lambda c: c.method == "diffusers-cp")
    for case in tqdm(ordered, desc=f"{w.name} {'/'.join(setup.levels)}", disable=dist.get_rank() != 0, leave=False):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with deadline(base.timeout_s), torch.no_grad():
            if case.method == "diffusers-cp":
                model = None
                model = _build(setup, device)
            ms, errors, links = _bench_case(model, case, setup, ref, device, groups)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        worst = torch.tensor([*errors, peak], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        for level in (x for x in setup.levels if x in ms):
            if case.method == "bound":
                bound_ms[level, case.variant] = ms[level].median
            bound = bound_ms.get((level, case.variant), bound_ms.get((level, "eager")))  # like with like
            table[level].append(dict(
                workload=w.name, level=level, tokens=w.tokens + w.text_tokens, method=case.name,
                layout=case.label, **ms[level].row(), max_abs_err=None, link_bound_ms=links[level],
                vs_bound=over_bounds(ms[level].median, bound, links[level]),
                rel_err=None if case.method == "bound" else worst[LEVELS.index(level)].item(),
                peak_gib=worst[2].item() if device.type == "cuda" else None))
    return [row for level in setup.levels for row in table[level]]


def _relative(out: Tensor, ref: Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()

"""How one bench case runs the model: ours through `parallelize`, diffusers' context parallelism through
`enable_parallelism` (over the same emulated link as ours, emulated_cp.py), or the no-communication bound, our
processors with an attention that moves nothing (model.py times them)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig, FluxTransformer2DModel
from diffusers.hooks import HookRegistry
from diffusers.models.transformers.transformer_flux import _get_qkv_projections
from torch import Tensor

from .. import init_parallel
from ..backends.emulated import EmulatedNic
from ..core.links import parse_link
from ..core.mesh import GroupCache
from ..diffusers.parallel_pipeline import parallelize, unparallelize
from ..diffusers.plans import plan_for
from ..diffusers.processors import CogVideoXSPAttnProcessor, FluxSPAttnProcessor, ShardState
from ..diffusers.processors.flux import flux_output, rotary_qkv
from ..diffusers.sharding import GATHER_HOOK
from .bound import local_attention
from .emulated_cp import over_emulated_link
from .layer import Case, Setup, parallel_config
from .variants import compiled, parallelize_options


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


__all__ = ["CogVideoXBoundProcessor", "FluxBoundProcessor", "set_up"]

"""Sequence-parallel processor for diffusers' FluxAttention (the joint blocks and the single blocks), for
`set_attn_processor` users: diffusers' own FluxAttnProcessor on the "streamfusion" backend, the very path
`parallelize` runs Flux's attention through (its stock processors routed to the backend, routing.py)."""
from __future__ import annotations

from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from ...context import ParallelContext
from .backend import Route, backend_name
from .base import ShardState, SPAttnProcessor


class FluxSPAttnProcessor(SPAttnProcessor, FluxAttnProcessor):
    """diffusers' FluxAttnProcessor with its attention run by `sp_attention` (through `attend`, which a variant
    may swap). Joint blocks get text (`encoder_hidden_states`) and image tokens and return both; single blocks
    get the already-concatenated [text ; image] tokens and return one tensor: the stock call and return.
    `state` tells which leading tokens are replicated text (None: equal slices, no joint tokens)."""

    def __init__(self, ctx: ParallelContext, state: ShardState | None = None):
        FluxAttnProcessor.__init__(self)
        SPAttnProcessor.__init__(self, ctx, state)
        self._attention_backend = backend_name()
        self._parallel_config = Route(self.ctx, self.state, type(self).__name__, self.attend)

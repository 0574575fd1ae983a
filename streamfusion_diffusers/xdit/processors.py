"""Our Flux and CogVideoX processors under xfuser's call convention (no xfuser import here).

xfuser calls a processor with its attention wrapper as `attn` (the diffusers module's weights behind it), with
this SP rank's equal slice of the image/video tokens, and with the text tokens either split over the SP ranks
too (xfuser's `split_text_embed_in_sp`, when the text length divides the SP degree) or whole on every rank. Split
text is just more sequence; whole text enters `sp_attention` as joint tokens, counted once. The processors learn
which from `text_split()` at every call that carries the text (every CogVideoX block, Flux's joint blocks) and
share it through one ShardState with the calls that do not (Flux's single blocks, which run after).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..context import ParallelContext
from ..diffusers.processors import CogVideoXSPAttnProcessor, FluxSPAttnProcessor, ShardState, TokenLayout


def text_layout(rank: int, world_size: int, text_split: bool, text_local: int, image_local: int) -> TokenLayout | None:
    """The TokenLayout of one xfuser forward: None (equal slices, text among them) when xfuser split the text,
    else the whole text as joint tokens before equal image slices."""
    if text_split:
        return None
    return TokenLayout(rank=rank, text_total=text_local, text_sharded=False, image_lens=(image_local,) * world_size)


class XDiTFluxAttnProcessor(FluxSPAttnProcessor):
    """FluxSPAttnProcessor for xfuser's Flux: joint blocks publish the text layout, single blocks reuse it."""

    def __init__(self, ctx: ParallelContext, text_split: Callable[[], bool], state: ShardState | None = None):
        super().__init__(ctx, state)
        self.text_split = text_split

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is not None:
            self.state.layout = text_layout(self.ctx.rank, self.ctx.world_size, self.text_split(),
                                            encoder_hidden_states.shape[1], hidden_states.shape[1])
        elif self.state.layout is None and not self.text_split():
            raise ValueError("a Flux single block ran with whole (unsplit) text before any joint block told how "
                             "long it is; streamfusion's xDiT adapter needs the model's joint blocks to run first")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class XDiTCogVideoXAttnProcessor(CogVideoXSPAttnProcessor):
    """CogVideoXSPAttnProcessor for xfuser's CogVideoX; every block carries the text, so each call sets the layout."""

    def __init__(self, ctx: ParallelContext, text_split: Callable[[], bool], state: ShardState | None = None):
        super().__init__(ctx, state)
        self.text_split = text_split

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        latte_temporal_attention: bool = False,  # xfuser's attention wrapper passes it to every processor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if latte_temporal_attention:
            raise ValueError("Latte's temporal attention is not a CogVideoX layer; run Latte without streamfusion")
        self.state.layout = text_layout(self.ctx.rank, self.ctx.world_size, self.text_split(),
                                        encoder_hidden_states.shape[1], hidden_states.shape[1])
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

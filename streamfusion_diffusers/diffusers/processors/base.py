"""What every sequence-parallel processor shares: the token layout of the current forward, and the attention call."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...attention import sp_attention
from ...context import ParallelContext
from ...core.sequence import split_sizes


@dataclass(frozen=True)
class TokenLayout:
    """How one forward's tokens lie on the ranks: image/video tokens split, text split or replicated.

    Text tokens come first in the processors' attention calls (Flux and CogVideoX both concatenate
    [text ; image]). `parallelize` splits them like the image tokens, as `split_sizes` cuts (uneven slices
    allowed), as diffusers' context parallelism does; callers that keep them whole on every rank (xDiT's) pass
    text_sharded=False and they enter `sp_attention` as joint tokens. A model whose self-attention sees no
    text (Wan) has text_total=0.
    """

    rank: int
    text_total: int
    text_sharded: bool
    image_lens: tuple[int, ...]
    joint_last: bool = False  # replicated text after the image rows (HunyuanVideo's [video ; text])
    # read at every attention call, so fields set from the above once per layout rather than properties:
    joint: int = field(init=False, compare=False)  # leading tokens of each attention call every rank holds in full
    text_lens: list[int] = field(init=False, compare=False)  # every rank's split text tokens (zeros: replicated)
    seq_lens: list[int] = field(init=False, compare=False)  # every rank's split rows, sp_attention(seq_lens=...)

    def __post_init__(self) -> None:
        text_lens = split_sizes(self.text_total if self.text_sharded else 0, self.world_size)
        object.__setattr__(self, "joint", 0 if self.text_sharded else self.text_total)
        object.__setattr__(self, "text_lens", text_lens)
        object.__setattr__(self, "seq_lens", [text + n for text, n in zip(text_lens, self.image_lens)])

    @property
    def world_size(self) -> int:
        return len(self.image_lens)

    @property
    def text_range(self) -> tuple[int, int]:
        """This rank's text tokens, as a [start, stop) range of the whole text."""
        if not self.text_sharded:
            return 0, self.text_total
        start = sum(self.text_lens[: self.rank])
        return start, start + self.text_lens[self.rank]

    @property
    def image_range(self) -> tuple[int, int]:
        """This rank's image/video tokens, as a [start, stop) range of the whole image sequence."""
        start = sum(self.image_lens[: self.rank])
        return start, start + self.image_lens[self.rank]


@dataclass
class ShardState:
    """Shared by the sharding hook (which sets `layout` before each forward) and the processors (which read it).

    With no layout (processors installed without `parallelize`), every rank is assumed to hold an equal slice
    and no joint tokens: the caller shards the inputs itself.
    """

    layout: TokenLayout | None = field(default=None)


def reject_mask(attention_mask: Tensor | None) -> None:
    if attention_mask is not None:
        raise ValueError("sequence-parallel attention computes unmasked softmax attention; call the transformer "
                         "without attention_mask (diffusers' Flux and CogVideoX pipelines pass none)")


class SPAttnProcessor:
    """What both processors share: the context and the shard state their attention runs with (`attend`)."""

    def __init__(self, ctx: ParallelContext, state: ShardState | None = None):
        self.ctx = ctx
        self.state = state if state is not None else ShardState()


def attend(query: Tensor, key: Tensor, value: Tensor, ctx: ParallelContext, state: ShardState,
           scale: float | None = None, key_mask: Tensor | None = None) -> Tensor:
    """Attention of the local rows [joint ; sharded] (or [sharded ; joint]) of q, k, v ([B, L, H, D]) over the
    whole sequence; key_mask: [B, L] bool over the same rows (False: a padded key no query attends)."""
    layout = state.layout
    if layout is None:
        return sp_attention(query, key, value, ctx, scale=scale, key_mask=key_mask)
    joint = layout.joint
    if joint == 0:
        return sp_attention(query, key, value, ctx, seq_lens=layout.seq_lens, scale=scale, key_mask=key_mask)
    rows, text = (slice(None, -joint), slice(-joint, None)) if layout.joint_last else (slice(joint, None),
                                                                                       slice(None, joint))
    masks = (key_mask[:, rows], key_mask[:, text]) if key_mask is not None else (None, None)
    out, joint_out = sp_attention(query[:, rows], key[:, rows], value[:, rows], ctx, joint_q=query[:, text],
                                  joint_k=key[:, text], joint_v=value[:, text], seq_lens=layout.seq_lens,
                                  scale=scale, key_mask=masks[0], joint_key_mask=masks[1])
    return torch.cat([out, joint_out] if layout.joint_last else [joint_out, out], dim=1)

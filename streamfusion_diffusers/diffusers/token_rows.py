"""A tensor-parallel block's token rows: its split inputs made whole at its entry, its outputs cut back to this
rank's rows (tensor_blocks.py runs the blocks).

A block's arguments and outputs that are token rows, and of which stream (text, image, or both joined as
[text ; image]), `BlockRows` says per block class; rotary tables are tuples of tables whose rows (their first dim)
are tokens of a stream each. Rows are gathered in rank order per stream, as the forward's `TokenLayout` lies them,
so [text ; image] comes whole in the model's own order. The wrap sits around the block's own forward, inside
every hook on the block (the plan's input splits, a cache that may skip it), which see this rank's rows as before.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.sequence import gather
from .processors import ShardState, TokenLayout

TEXT, IMAGE, JOINT = "text", "image", "joint"


@dataclass(frozen=True)
class BlockRows:
    """Which forward arguments of a block class are token rows, by name: a stream (a tensor's rows along dim 1),
    or a stream per table of a tuple (rotary tables: rows along dim 0); the stream of each output in order (a
    block returning one tensor: one entry); the stream each of its all-reduces carries (`summed`: its
    row-parallel projections', for what a forward moves); and its modulation projections (`modulation`, paths in
    the block: cut colwise, their outputs gathered)."""

    inputs: Mapping[str, str | tuple[str, ...]]
    outputs: tuple[str, ...]
    summed: tuple[str, ...]
    modulation: tuple[str, ...] = ()


class TokenRows:
    """Turns a block's row arguments whole and its outputs back into this rank's rows, as the forward's token
    layout says. Nothing is gathered twice: a forward's rotary tables once for all the blocks they enter, and rows
    a tensor-parallel block just cut out of its whole output (every rank computed the same whole rows) are taken
    whole from that output by the next block they enter unchanged."""

    def __init__(self, state: ShardState, group: dist.ProcessGroup):
        self.state = state
        self.group = group
        self._tables: tuple[Any, Any] = (None, None)  # (the last tables given, their whole rows)
        self._cut: list[tuple[Tensor, Tensor, str]] = []  # the last block's outputs: (its rows here, whole, stream)

    @property
    def layout(self) -> TokenLayout:
        return self.state.layout

    def _text_rows(self) -> int:
        layout = self.layout
        return layout.text_lens[layout.rank] if layout.text_sharded else layout.text_total

    def whole(self, x: Tensor, stream: str, dim: int = 1) -> Tensor:
        layout = self.layout
        if stream == IMAGE:
            return gather(x, list(layout.image_lens), self.group, dim)
        if stream == TEXT:
            return gather(x, layout.text_lens, self.group, dim) if layout.text_sharded else x
        text = self._text_rows()
        return torch.cat([self.whole(x.narrow(dim, 0, text), TEXT, dim),
                          self.whole(x.narrow(dim, text, x.shape[dim] - text), IMAGE, dim)], dim=dim)

    def mine(self, y: Tensor, stream: str, dim: int = 1) -> Tensor:
        layout = self.layout
        if stream == JOINT:
            text = layout.text_total
            return torch.cat([self.mine(y.narrow(dim, 0, text), TEXT, dim),
                              self.mine(y.narrow(dim, text, y.shape[dim] - text), IMAGE, dim)], dim=dim)
        start, stop = layout.image_range if stream == IMAGE else layout.text_range
        return y.narrow(dim, start, stop - start).contiguous()

    def enter(self, x: Tensor, stream: str) -> Tensor:
        """A block's row argument made whole."""
        if not torch.compiler.is_compiling():  # a compiled block gathers its own (no state across graphs)
            for mine, whole, cut_stream in self._cut:
                if x is mine and cut_stream == stream:
                    return whole
        return self.whole(x, stream)

    def leave(self, outputs: Sequence[Tensor], streams: Sequence[str]) -> list[Tensor]:
        """A block's whole outputs cut back to this rank's rows."""
        cut = [self.mine(y, stream) for y, stream in zip(outputs, streams)]
        if not torch.compiler.is_compiling():
            self._cut = list(zip(cut, outputs, streams))
        return cut

    def tables(self, tables: tuple[Tensor, ...], streams: tuple[str, ...]) -> tuple[Tensor, ...]:
        compiling = torch.compiler.is_compiling()  # a compiled block gathers its own (no state across graphs)
        if not compiling and tables is self._tables[0]:
            return self._tables[1]
        whole = tuple(self.whole(t, stream, dim=0) for t, stream in zip(tables, streams))
        if not compiling:
            self._tables = (tables, whole)
        return whole


def _bound(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    return {**dict(zip(names, args)), **kwargs}


def _wrap_innermost(block: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap the block's own forward, inside the diffusers hooks on it (their chain ends in the forward the first
    of them was given: a hook's `new_forward` calls it as `fn_ref.original_forward`)."""
    registry = getattr(block, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None)
    if not refs:
        block.forward = wrap(block.forward)
        return
    where = "original_forward" if refs[0].original_forward is not None else "forward"
    setattr(refs[0], where, wrap(getattr(refs[0], where)))


def wrap_block(block: nn.Module, rows: BlockRows, tokens: TokenRows) -> None:
    """The block's forward with its row arguments made whole and its outputs cut back to this rank's rows."""
    names = tuple(inspect.signature(type(block).forward).parameters)[1:]
    _wrap_innermost(block, lambda forward: _tensor_parallel(forward, names, rows, tokens))


def _tensor_parallel(forward: Callable[..., Any], names: tuple[str, ...], rows: BlockRows, tokens: TokenRows
                     ) -> Callable[..., Any]:
    def tensor_parallel_forward(*args: Any, **kwargs: Any) -> Any:
        given = _bound(names, args, kwargs)
        for name, stream in rows.inputs.items():
            value = given.get(name)
            if value is not None:
                given[name] = tokens.tables(value, stream) if isinstance(stream, tuple) else tokens.enter(value, stream)
        out = forward(**given)
        if isinstance(out, tuple):
            return tuple(tokens.leave(out, rows.outputs))
        return tokens.leave([out], rows.outputs)[0]

    return tensor_parallel_forward

__all__ = ["IMAGE", "JOINT", "TEXT", "BlockRows", "TokenRows", "wrap_block"]

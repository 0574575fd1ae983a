"""A unit of parameters as one flat byte buffer, cut into equal aligned shards: the layout `shard_weights` gathers.

A unit's parameters (a quantized weight's inner tensors too: torchao's int8 / fp8 data and scales, 1 byte a value)
are laid end to end, each tensor at a multiple of ALIGN bytes, the whole padded to split into one aligned shard per
rank. `FlatUnit` cuts this rank's shard and then makes every parameter a view into a gathered buffer (its dtype,
shape and strides kept), so the parameters never move; `unit_bytes` and `padded` size the same layout for the
choice of what to shard (weight_split.py) without building it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

ALIGN = 16  # bytes: every tensor starts at a multiple of this in its flat buffer (any dtype's view is aligned)


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def leaves(t: Tensor) -> list[Tensor]:
    """The plain tensors a parameter holds: itself, or a tensor subclass's (torchao's) inner tensors, recursively."""
    if type(t) in (Tensor, nn.Parameter):
        return [t.detach()]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in leaves(getattr(t, name))]


def rebuild(t: Tensor, inner: list[Tensor]) -> Tensor:
    """t rebuilt around `inner` (in `leaves`' order), consumed from the front."""
    if type(t) in (Tensor, nn.Parameter):
        return inner.pop(0)
    names, ctx = t.__tensor_flatten__()
    parts = {name: rebuild(getattr(t, name), inner) for name in names}
    return type(t).__tensor_unflatten__(parts, ctx, t.size(), t.stride())


def unit_bytes(modules: Sequence[nn.Module], skip: Sequence[nn.Module] = ()) -> int:
    """The flat buffer size of these modules' parameters (those of `skip`'s subtrees left out), before padding."""
    skipped = {id(p) for m in skip for p in m.parameters()}
    seen: set[int] = set()
    size = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen and id(p) not in skipped:
                seen.add(id(p))
                size += sum(-(-nbytes(leaf) // ALIGN) * ALIGN for leaf in leaves(p))
    return size


def padded(size: int, ranks: int) -> int:
    """A flat buffer's size rounded up so that it splits into `ranks` aligned shards."""
    step = ranks * ALIGN
    return -(-size // step) * step


class FlatUnit:
    """One flat buffer's worth of parameters: where each lives in the buffer, this rank's shard of it."""

    def __init__(self, modules: Sequence[nn.Module], skip: Sequence[nn.Module], ranks: int):
        skipped = {id(p) for m in skip for p in m.parameters()}
        inside = {id(sub) for m in skip for sub in m.modules()}
        sites: dict[int, list[tuple[nn.Module, str]]] = {}
        params: dict[int, Tensor] = {}
        for module in modules:
            for sub in module.modules():
                if id(sub) in inside:
                    continue
                for name, p in sub._parameters.items():
                    if p is not None and id(p) not in skipped:
                        params[id(p)] = p
                        sites.setdefault(id(p), []).append((sub, name))
        self.params = list(params.values())
        self.sites = [sites[id(p)] for p in self.params]
        self.offsets: list[list[int]] = []
        size = 0
        for p in self.params:
            offs = []
            for leaf in leaves(p):
                offs.append(size)
                size += -(-nbytes(leaf) // ALIGN) * ALIGN
            self.offsets.append(offs)
        self.size = padded(size, ranks)
        self.ranks = ranks
        self.shard: Tensor | None = None

    def flatten(self, device: torch.device) -> Tensor:
        """The unit's parameters laid end to end, as bytes, on `device`."""
        flat = torch.zeros(self.size, dtype=torch.uint8, device=device)
        for p, offs in zip(self.params, self.offsets):
            for leaf, off in zip(leaves(p), offs):
                flat[off:off + nbytes(leaf)].copy_(leaf.contiguous().reshape(-1).view(torch.uint8))
        return flat

    def keep_shard(self, flat: Tensor, rank: int, own: bool) -> None:
        """This rank's 1/P of `flat`: its own copy, or (own=False: the flat stays whole) a view into it."""
        share = self.size // self.ranks
        piece = flat[rank * share:(rank + 1) * share]
        self.shard = piece.clone() if own else piece

    def bind(self, buffer: Tensor) -> None:
        """Every parameter a view into `buffer` (the gathered flat), its dtype, shape and strides kept."""
        for i, (p, offs, sites) in enumerate(zip(self.params, self.offsets, self.sites)):
            inner = leaves(p)
            views = [buffer[off:off + nbytes(leaf)].view(leaf.dtype).view(leaf.shape)
                     for leaf, off in zip(inner, offs)]
            new = nn.Parameter(rebuild(p, views), requires_grad=False)
            for module, name in sites:
                module._parameters[name] = new
            self.params[i] = new


__all__ = ["ALIGN", "FlatUnit", "leaves", "nbytes", "padded", "rebuild", "unit_bytes"]

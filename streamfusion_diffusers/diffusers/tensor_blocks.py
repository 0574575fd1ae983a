"""Streamed blocks run tensor-parallel: a sharded block whose tokens move instead of its weights.

A streamed block gathered in place (sharded_weights.py) receives (P-1)/P of its weights at every forward, at image
sizes many times the bytes of its tokens. Run tensor-parallel, it keeps 1/P of each projection the model's
diffusers `_tp_plan` cuts (colwise: a share of its output features, so of its heads; rowwise: the matching share
of its input features, the partial products summed over the ranks by all-reduce, the bias added after) and never
gathers them. Its tokens are gathered instead: each input split over the sequence-parallel ranks is all-gathered
whole at the block's entry, the block runs on every token with its share of the heads (the stock attention,
local: inside the block nothing of the sequence is split) and each output is cut back to this rank's rows; the
next tensor-parallel block takes those rows whole from that output (every rank computed the same), so a run of
such blocks moves, per block, only what its all-reduces carry. A block's own modulation (the AdaLN projections of
the timestep embedding, which the diffusers plan leaves whole) is cut colwise too, its few outputs per sample
all-gathered. A rank holds 1/P of the cut projections and the rest of the block (norms) whole.

Here: which projections a block cuts and how (its `_tp_plan` entries and, per block class, `BLOCK_ROWS`: its rows'
streams and its modulation), the cut (plain weights, and torchao's quantized ones: their data cut, their per-row
scales with it), and why a model's blocks cannot run so (LoRA-wrapped projections: those blocks stream gathered).
The rows in and out: token_rows.py. Exact up to the order of the row-parallel sums.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.sequence import gather
from .flat_units import nbytes
from .overlap_mlp import MLP_HOOK
from .processors import ShardState
from .token_rows import IMAGE, JOINT, TEXT, BlockRows, TokenRows, wrap_block



# diffusers' transformer blocks whose models carry a `_tp_plan`, by class name
_ROTARY = (JOINT, JOINT)  # Flux's (cos, sin) tables, over [text ; image]
_TWO_STREAMS = (IMAGE, TEXT, IMAGE, TEXT)  # attention out, added out, MLP out, context MLP out
BLOCK_ROWS: dict[str, BlockRows] = {
    "FluxTransformerBlock": BlockRows({"hidden_states": IMAGE, "encoder_hidden_states": TEXT,
                                       "image_rotary_emb": _ROTARY}, (TEXT, IMAGE), _TWO_STREAMS,
                                      ("norm1.linear", "norm1_context.linear")),
    "FluxSingleTransformerBlock": BlockRows({"hidden_states": IMAGE, "encoder_hidden_states": TEXT,
                                             "image_rotary_emb": _ROTARY}, (TEXT, IMAGE), (JOINT,), ("norm.linear",)),
    "Flux2TransformerBlock": BlockRows({"hidden_states": IMAGE, "encoder_hidden_states": TEXT,
                                        "image_rotary_emb": _ROTARY}, (TEXT, IMAGE), _TWO_STREAMS),
    "Flux2SingleTransformerBlock": BlockRows({"hidden_states": JOINT, "image_rotary_emb": _ROTARY}, (JOINT,),
                                             (JOINT,)),
    "QwenImageTransformerBlock": BlockRows({"hidden_states": IMAGE, "encoder_hidden_states": TEXT,
                                            "encoder_hidden_states_mask": TEXT, "image_rotary_emb": (IMAGE, TEXT),
                                            "modulate_index": IMAGE},  # Edit-2511's per-token modulation
                                           (TEXT, IMAGE), _TWO_STREAMS, ("img_mod.1", "txt_mod.1")),
}


def _styles() -> tuple[type, type] | None:
    try:
        from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel
    except ImportError:  # diffusers before tensor-parallel plans
        return None
    return PackedColwiseParallel, PackedRowwiseParallel


GATHERED = -1  # a Cut's dim for a modulation projection: colwise, its outputs all-gathered


def block_plan(model: nn.Module, name: str, block: nn.Module) -> dict[nn.Linear, tuple[int, list[int]]]:
    """The projections of `block` (named `name` in `model`) that run cut: those its model's `_tp_plan` cuts, each
    Linear's cut dim of its weight (0: colwise, 1: rowwise) and the sizes of the fused parts cut apart along it,
    and its modulation projections (GATHERED: a contiguous share of the outputs, gathered after)."""
    styles = _styles()
    plan = getattr(type(model), "_tp_plan", None)
    if styles is None or not plan:
        return {}
    packed_col, packed_row = styles
    found: dict[nn.Linear, tuple[int, list[int]]] = {}
    for pattern, style in plan.items():
        prefix, _, rest = pattern.partition(".*.")
        if not rest or name.rpartition(".")[0] != prefix:
            continue
        linear = block.get_submodule(rest)
        dim = 0 if style == "colwise" or isinstance(style, packed_col) else 1
        parts = style.blocks if isinstance(style, (packed_col, packed_row)) else None
        if parts is None and isinstance(style, (packed_col, packed_row)):
            parts = getattr(linear, "_tp_packed_col_blocks" if dim == 0 else "_tp_packed_row_blocks")
        size = linear.weight.shape[dim]
        parts = parts or [size]
        unit = size // sum(parts)
        found[linear] = (dim, [p * unit for p in parts])
    rows = BLOCK_ROWS.get(type(block).__name__)
    for path in rows.modulation if found and rows is not None else ():
        linear = block.get_submodule(path)
        found[linear] = (GATHERED, [linear.weight.shape[0]])
    return found


def summed_rows(block: nn.Module) -> tuple[int, int]:
    """How many times a forward of the block all-reduces its (image, text) rows at the model's width."""
    rows = BLOCK_ROWS.get(type(block).__name__)
    streams = rows.summed if rows is not None else ()
    return (sum(s in (IMAGE, JOINT) for s in streams), sum(s in (TEXT, JOINT) for s in streams))


def _inner(weight: Tensor, dim: int) -> list[tuple[str | None, Tensor, bool]]:
    """A weight's plain tensors (a quantized weight's: its data and its scales) and whether each is cut along `dim`
    with it (it spans the weight's extent there; a per-row scale of a rowwise cut does not, and stays whole)."""
    if type(weight) in (Tensor, nn.Parameter):
        return [(None, weight.detach(), True)]
    names, _ = weight.__tensor_flatten__()
    found = []
    for name in names:
        inner = getattr(weight, name)
        if type(inner) not in (Tensor, nn.Parameter) or inner.dim() != weight.dim():
            raise ValueError(f"its {type(weight).__name__} weights hold a {name} the cut cannot follow")
        if inner.shape[dim] not in (weight.shape[dim], 1):
            raise ValueError(f"its {type(weight).__name__} weights' {name} of shape {tuple(inner.shape)} does not "
                             f"follow the weight along dim {dim}")
        found.append((name, inner, inner.shape[dim] == weight.shape[dim]))
    return found


def sliced_bytes(plan: Mapping[nn.Linear, tuple[int, list[int]]]) -> int:
    """The bytes of what a block's plan cuts (the weights' tensors that span the cut dim, and colwise biases)."""
    total = 0
    for linear, (dim, _) in plan.items():
        try:
            total += sum(nbytes(t) for _, t, cut in _inner(linear.weight, max(dim, 0)) if cut)
        except ValueError:  # a weight no cut follows: its model streams gathered (tensor_parallel_refusal)
            return 0
        if dim != 1 and linear.bias is not None:
            total += nbytes(linear.bias)
    return total


def tensor_parallel_refusal(model: nn.Module, named_blocks: Sequence[tuple[str, nn.Module]], ranks: int) -> str:
    """Why `model`'s streamed blocks cannot run tensor-parallel over `ranks` ("" where they can)."""
    if not getattr(type(model), "_tp_plan", None) or _styles() is None:
        return f"{type(model).__name__} has no diffusers tensor-parallel plan (_tp_plan)"
    heads = model.config.get("num_attention_heads")
    if heads is None or heads % ranks:
        return f"its {heads} attention heads do not divide over {ranks} ranks"
    for name, block in named_blocks:
        if type(block).__name__ not in BLOCK_ROWS:
            return f"its block {type(block).__name__} has no row streams here"
        for linear, (dim, parts) in block_plan(model, name, block).items():
            if type(linear) is not nn.Linear:
                return f"{name} holds a LoRA-wrapped projection ({type(linear).__name__})"
            try:
                _inner(linear.weight, max(dim, 0))
            except ValueError as err:
                return str(err)
            if any(p % ranks for p in parts):
                return f"{name}'s projections of {parts} features do not divide over {ranks} ranks"
    return ""


def _cut(t: Tensor, dim: int, parts: list[int], rank: int, ranks: int) -> Tensor:
    """This rank's share of each fused part of `t` along `dim`, joined."""
    pieces, offset = [], 0
    for size in parts:
        share = size // ranks
        pieces.append(t.narrow(dim, offset + rank * share, share))
        offset += size
    return torch.cat(pieces, dim=dim).contiguous()


def _cut_weight(weight: Tensor, dim: int, parts: list[int], rank: int, ranks: int, device: torch.device) -> Tensor:
    """This rank's share of a weight: plain, or quantized (torchao's int8 / fp8: its data cut, its per-row scales
    cut with the rows or kept whole for a cut of the columns, its block size following)."""
    inner = _inner(weight, dim)
    if inner[0][0] is None:
        return _cut(inner[0][1], dim, parts, rank, ranks).to(device)
    names, meta = weight.__tensor_flatten__()
    cut = {name: (_cut(t, dim, parts, rank, ranks) if along else t).to(device) for name, t, along in inner}
    size = list(weight.shape)
    size[dim] = sum(parts) // ranks
    meta = dict(meta)
    if "block_size" in meta and meta["block_size"][dim] == weight.shape[dim]:  # one block along the cut dim
        meta["block_size"] = [size[dim] if i == dim else b for i, b in enumerate(meta["block_size"])]
    strides = torch.empty(size, device="meta").stride()
    return type(weight).__tensor_unflatten__(cut, meta, torch.Size(size), strides)


class _GatherColumns:
    """A modulation projection's forward hook: every rank's share of the output features, gathered in order."""

    def __init__(self, group: dist.ProcessGroup, share: int):
        self.group, self.shares = group, [share] * dist.get_world_size(group)

    def __call__(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        return gather(out, self.shares, self.group, dim=-1)


class _SumRows:
    """A rowwise projection's forward hook: the ranks' partial products summed, then the bias added once."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        dist.all_reduce(out, group=self.group)
        return out if module.summed_bias is None else out.add_(module.summed_bias)  # out: the product, fresh


def cut_block(plan: Mapping[nn.Linear, tuple[int, list[int]]], group: dist.ProcessGroup, device: torch.device
              ) -> None:
    """Keep this rank's share of each planned projection of a block (the rest of the block whole), on `device`."""
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    for linear, (dim, parts) in plan.items():
        linear.weight = nn.Parameter(_cut_weight(linear.weight, max(dim, 0), parts, rank, ranks, device),
                                     requires_grad=False)
        bias = linear.bias
        if dim != 1:
            if bias is not None:
                linear.bias = nn.Parameter(_cut(bias.detach(), 0, parts, rank, ranks).to(device), requires_grad=False)
            if dim == GATHERED:
                linear.register_forward_hook(_GatherColumns(group, linear.weight.shape[0]))
        else:
            linear.bias = None
            linear.register_parameter("summed_bias", None if bias is None else nn.Parameter(
                bias.detach().to(device), requires_grad=False))
            linear.register_forward_hook(_SumRows(group))


def run_tensor_parallel(model: nn.Module, named_blocks: Sequence[tuple[str, nn.Module]], state: ShardState,
                        group: dist.ProcessGroup, device: torch.device,
                        local_attention: Callable[[nn.Module], None]) -> None:
    """Cut each of `named_blocks` and run it tensor-parallel over `group` (the sequence-parallel ranks);
    `local_attention(block)` gives the block's attention back its stock processor."""
    tokens = TokenRows(state, group)
    for name, block in named_blocks:
        cut_block(block_plan(model, name, block), group, device)
        for p in block.parameters():  # the rest of the block whole, on the device
            p.data = p.data.to(device)
        for b in block.buffers():
            b.data = b.data.to(device)
        local_attention(block)
        registry = getattr(block, "_diffusers_hook", None)
        if registry is not None and registry.get_hook(MLP_HOOK) is not None:  # its all-to-alls beside the MLP: a
            registry.remove_hook(MLP_HOOK, recurse=False)  # tensor-parallel block has none
        wrap_block(block, BLOCK_ROWS[type(block).__name__], tokens)


__all__ = ["BLOCK_ROWS", "block_plan", "cut_block", "run_tensor_parallel", "sliced_bytes", "summed_rows",
           "tensor_parallel_refusal"]

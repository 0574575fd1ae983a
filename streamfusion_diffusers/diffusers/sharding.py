"""The hooks that apply a context-parallel plan (`plans/`): cut inputs by rank, gather outputs, track the layout.

Like diffusers' own plan hooks, with three differences: slices may differ in length (`sequence.split_sizes`:
diffusers' equipartition sharder asserts even splits), the token counts cut are published to the attention
(`TokenLayout`: every rank's split rows, for `sp_attention(seq_lens=...)`), and key masks are checked once per
forward (one that keeps every key is dropped; one that leaves keys out, padded prompts, is the attention's to
take: every rank attends all keys at once under Ulysses). The split self-attention sees [text ; image] rows as the plan left them on each rank, so its rows per
rank are the split counts of the two token streams, `encoder_hidden_states` and `hidden_states`. A text shorter
than the ranks stays whole (with every input of its length: ids, masks, rotary tables) and enters the attention
as joint tokens, counted once.
"""
from __future__ import annotations

import inspect
import logging
import re
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models._modeling_parallel import ContextParallelOutput
from torch import Tensor

from ..context import ParallelContext
from ..core.sequence import gather, split_sizes
from .plans import ModelPlan
from .plans.plan import AfterText, KeptText
from .processors import ShardState, TokenLayout
from .stack.skips import agree_skips, lead_blocks

logger = logging.getLogger(__name__)

FORWARD_HOOK = "streamfusion_forward"
SPLIT_HOOK, GATHER_HOOK = "streamfusion_split---{}", "streamfusion_gather---{}"
IMAGE, TEXT = "hidden_states", "encoder_hidden_states"  # the token streams the split self-attention sees


@dataclass
class PlanState(ShardState):
    """ShardState plus what the hooks learn during one forward: the split streams' token counts, and the key-mask
    inputs this forward was given and found to keep every token (a mask the attention then receives is built from
    them and is dropped unread; with none checked, the attention checks any mask it gets itself), or that one of
    them leaves keys out (`key_padding`: the attention's mask is then taken, unread on the host)."""

    streams: dict[str, int] = field(default_factory=dict)
    masks_checked: tuple[str, ...] = ()
    key_padding: bool = False  # a key-mask input of this forward leaves some keys out (padded prompts)
    mask_verdicts: dict[tuple, tuple[bool, Tensor]] = field(default_factory=dict)  # this forward's masks no hook
    # checked, by view: whether they keep every key on every rank, with the mask (processors/backend.py)
    joint_text: int = 0  # this forward's text, kept whole (fewer tokens than ranks); 0: split like the image
    text_last: bool = False
    kept_text: tuple[int, int] | None = None  # this forward's text mask (by id) and the text columns it keeps
    # every layout met so far, by (text, image tokens, joint text): a forward of a size seen before builds none
    layouts: dict[tuple[int, int, int], TokenLayout] = field(default_factory=dict, repr=False)

    def record(self, name: str, tokens: int, ctx: ParallelContext) -> None:
        self.streams[name] = tokens
        text, image = self.streams.get(TEXT, self.joint_text), self.streams.get(IMAGE, 0)
        key = (text, image, self.joint_text)
        # compiled code builds the layout afresh: a read of this cache would guard the graph on its contents, and
        # the entry the first call adds would compile every hooked block again at the second
        compiling = torch.compiler.is_compiling()
        layout = None if compiling else self.layouts.get(key)
        if layout is None:
            layout = TokenLayout(rank=ctx.rank, text_total=text, text_sharded=not self.joint_text,
                                 joint_last=self.text_last, image_lens=tuple(split_sizes(image, ctx.world_size)))
            if not compiling:
                self.layouts[key] = layout
        self.layout = layout


def _slice(name: str, tokens: int, ctx: ParallelContext) -> tuple[int, int]:
    """This rank's (start, length) of `tokens` split over the SP group, as `sequence.shard` cuts them."""
    world = ctx.world_size
    if tokens < world:
        what = "text" if "txt" in name or "encoder" in name else "image/video"  # ids, rotary tables: image
        raise ValueError(f"{tokens} {what} tokens cannot be split over {world} ranks; raise the resolution (or the "
                         f"frame count, or the prompt length) to at least {world} tokens, or run on fewer ranks")
    lens = split_sizes(tokens, world)
    return sum(lens[:ctx.rank]), lens[ctx.rank]


def parameter_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The names of a module's forward parameters, in order (read once, when a hook is installed)."""
    return tuple(inspect.signature(module.forward).parameters)


class PlanSplitHook(ModelHook):
    """Cut one module's inputs (by name) or outputs (by index) along their plan dims, this rank's slice."""

    def __init__(self, ctx: ParallelContext, state: PlanState, spec: dict[str | int, Any], image: str = IMAGE):
        super().__init__()
        self.ctx, self.state, self.spec = ctx, state, spec
        self.image = image  # the model's name for the split image tokens (Z-Image's blocks take them as `x`)
        self.names: tuple[str, ...] = ()
        self.slices: dict[int, tuple[int, int]] = {}  # token count -> this rank's (start, length), per size once
        self.cut_outputs = tuple((i, s) for i, s in spec.items() if isinstance(i, int))
        self.kept_mask = next((n for n, s in spec.items() if isinstance(s, KeptText)), None)

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.names = parameter_names(module)
        return module

    def _cut(self, name: str | int, value: Any, spec: Any) -> Any:
        if isinstance(value, (tuple, list)):
            specs = spec if isinstance(spec, (tuple, list)) else [spec] * len(value)
            return type(value)(self._cut(name, v, s) for v, s in zip(value, specs))
        if not isinstance(value, Tensor) or (spec.expected_dims is not None and value.dim() < spec.expected_dims):
            return value  # an input with no token dim (Wan's per-batch timestep, not per token) stays whole
        if spec.expected_dims is not None and value.dim() != spec.expected_dims:
            raise ValueError(f"{name} has {value.dim()} dims, the plan cuts it as {spec.expected_dims}: pass it as "
                             f"diffusers' pipelines do (e.g. Flux's txt_ids / img_ids as 2-D [L, 3] tensors)")
        if isinstance(spec, AfterText):  # the whole text's rows in front, then this rank's image rows
            dim, text = spec.split_dim, self.state.joint_text
            start, length = _slice(str(name), value.shape[dim] - text, self.ctx)
            return torch.cat([value.narrow(dim, 0, text), value.narrow(dim, text + start, length)], dim=dim)
        tokens = value.shape[spec.split_dim]
        name = IMAGE if name == self.image else name
        if name in (IMAGE, TEXT):
            self.state.record(name, tokens, self.ctx)
        if tokens == self.state.joint_text and name != IMAGE:
            return value  # the whole text, or an input of its length (ids, mask, rotary table)
        if torch.compiler.is_compiling():  # no cache read under the compiler (PlanState.record says why)
            return value.narrow(spec.split_dim, *_slice(str(name), tokens, self.ctx))
        cut = self.slices.get(tokens)
        if cut is None:
            cut = self.slices[tokens] = _slice(str(name), tokens, self.ctx)
        return value.narrow(spec.split_dim, *cut)

    def _kept_columns(self, mask: Tensor) -> int:
        """The text columns up to the last one some batch row keeps: read once per forward (every block gets the
        same mask)."""
        kept = self.state.kept_text
        if kept is None or kept[0] != id(mask):
            columns = mask.bool().any(0).nonzero()
            kept = self.state.kept_text = (id(mask), int(columns[-1]) + 1 if len(columns) else 0)
        return kept[1]

    def _drop_padding(self, args: list, kwargs: dict[str, Any]) -> None:
        """The text rows no query attends, and their mask columns, dropped before the cut (`KeptText`); the text
        itself where this module's plan cuts it (the first block), the mask at every block."""
        positions = {name: i for i, name in enumerate(self.names[:len(args)])}
        slots = {name: (kwargs, name) if name in kwargs else (args, positions[name])
                 for name in (self.kept_mask, TEXT) if name in kwargs or name in positions}
        holder, key = slots.get(self.kept_mask, ({}, None))
        mask = holder.get(key) if isinstance(holder, dict) else holder[key]
        if mask is None:
            return
        columns = self._kept_columns(mask)
        for name, (holder, key) in slots.items():
            value = holder[key]
            if name in self.spec and value is not None and value.shape[1] > columns:
                holder[key] = value[:, :columns]

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        args = list(args)  # by parameter name, without inspect's BoundArguments (torch.compile traces this)
        if self.kept_mask is not None:
            self._drop_padding(args, kwargs)
        for i, name in enumerate(self.names[:len(args)]):
            if name in self.spec and args[i] is not None:
                args[i] = self._cut(name, args[i], self.spec[name])
        for name, value in kwargs.items():
            if name in self.spec and value is not None:
                kwargs[name] = self._cut(name, value, self.spec[name])
        return tuple(args), kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if not self.cut_outputs:
            return output
        parts = [output] if isinstance(output, Tensor) else list(output)
        for i, spec in self.cut_outputs:
            parts[i] = self._cut(i, parts[i], spec)
        return parts[0] if isinstance(output, Tensor) else type(output)(parts)


class PlanGatherHook(ModelHook):
    """All-gather one module's output (the image/video tokens) from every rank's slice, in rank order."""

    def __init__(self, ctx: ParallelContext, state: PlanState, spec: ContextParallelOutput):
        super().__init__()
        self.ctx, self.state, self.spec = ctx, state, spec

    def post_forward(self, module: torch.nn.Module, output: Tensor) -> Tensor:
        layout = self.state.layout
        if IMAGE not in self.state.streams or layout is None:
            raise ValueError("the plan gathers an output but split no hidden_states before it")
        lens = layout.image_lens  # this forward's split, as the split hooks cut hidden_states
        if output.shape[self.spec.gather_dim] != lens[layout.rank]:
            raise ValueError(f"the gathered output has {output.shape[self.spec.gather_dim]} tokens on rank "
                             f"{layout.rank}, not its {lens[layout.rank]} split image tokens: the plan gathers "
                             f"a module whose output is not the split hidden_states")
        # the SP group: the whole job, or with CFG parallelism this rank's guidance branch
        return gather(output, lens, self.ctx.cfg.sp.pg, dim=self.spec.gather_dim)


class ForwardHook(ModelHook):
    """Around the whole transformer forward: a fresh layout, the plan's key masks checked once, and the skip
    decision of any First Block Cache agreed over the ranks (stack/skips.py)."""

    def __init__(self, ctx: ParallelContext, state: PlanState, key_masks: tuple[str, ...],
                 drop_full_masks: bool = False, text_whole: bool = False, text_rows: bool = True,
                 text_input: str = TEXT):
        super().__init__()
        self.ctx, self.state, self.key_masks, self.drop_full_masks = ctx, state, key_masks, drop_full_masks
        self.text_whole = text_whole  # the plan keeps the text whole at any length (else only below the ranks)
        self.text_rows = text_rows  # the split self-attention holds the text's rows (`ModelPlan.text_rows`)
        self.text_input = text_input  # the forward input of the text, or of its length (`ModelPlan.text_input`)
        self.positions: dict[str, int] = {}  # forward parameter -> its position
        self.leads: tuple[torch.nn.Module, ...] = ()  # where a First Block Cache puts its head hook
        self.full_masks: dict[int, tuple[weakref.ref, int]] = {}  # id -> (mask, its version) found to keep all

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.positions = {name: i for i, name in enumerate(parameter_names(module))}
        self.leads = lead_blocks(module)
        return module

    def _argument(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self.positions.get(name, len(args))
        return args[i] if i < len(args) else None

    def _keeps_every_key(self, mask: Tensor, compiling: bool) -> bool:
        """Whether the mask keeps every key: read from the device once per mask (a pipeline passes the same one at
        every step), not at every forward, which would wait for the GPU each time."""
        if compiling:
            return bool(mask.bool().all())
        seen = self.full_masks.get(id(mask))
        if seen is not None and seen[0]() is mask and seen[1] == mask._version:  # not written to since
            return True
        if not bool(mask.bool().all()):
            return False
        if len(self.full_masks) >= 8:
            self.full_masks.clear()
        self.full_masks[id(mask)] = (weakref.ref(mask), mask._version)
        return True

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        compiling = torch.compiler.is_compiling()
        if not compiling:  # a cache enabled before or after parallelize (none compiles whole)
            agree_skips(self.leads, self.ctx)
        checked, padding = [], False
        for name in self.key_masks:
            mask = self._argument(name, args, kwargs)
            if mask is None:
                continue
            if not self._keeps_every_key(mask, compiling):
                padding = True  # the attention takes it (a Ulysses layout), not dropped
                continue
            if self.drop_full_masks and name in kwargs:  # it keeps every key: the model runs as without it
                kwargs[name] = None
            checked.append(name)
        text = self._argument(self.text_input, args, kwargs) if self.text_rows else None
        if not isinstance(text, int):  # its length itself (Cosmos3's und_len), else its rows
            text = text.shape[1] if isinstance(text, Tensor) and text.dim() >= 3 else 0  # [B, L, (layers,) D]
        self.state.streams.clear()
        self.state.kept_text = None
        self.state.joint_text = text if self.text_whole or text < self.ctx.world_size else 0
        self.state.layout, self.state.masks_checked = None, () if padding else tuple(checked)
        self.state.key_padding = padding
        self.state.mask_verdicts.clear()
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.state.layout, self.state.masks_checked, self.state.key_padding = None, (), False
        self.state.mask_verdicts.clear()
        return output


def plan_modules(root: torch.nn.Module, module_id: str) -> list[torch.nn.Module]:
    """The modules a plan key names: "" the root, "blocks.0" one, "blocks.*" every block ("*" is one name)."""
    pattern = re.compile(re.escape(module_id).replace(r"\*", r"[^.]+"))
    found = [m for name, m in root.named_modules() if pattern.fullmatch(name)]
    if not found:
        raise ValueError(f"the context-parallel plan names {module_id!r}, which {type(root).__name__} does not have")
    return found


def plan_hooks(transformer: torch.nn.Module, plan: ModelPlan, ctx: ParallelContext, state: PlanState
               ) -> list[tuple[torch.nn.Module, ModelHook, str]]:
    """The split and gather hooks that apply `plan` to `transformer`, as (module, hook, name). The transformer's
    `ForwardHook` goes outside them (it must see the inputs whole), and outside a CUDA graph of the forward."""
    # One split hook a module, its plan entries merged ("blocks.0" and "blocks.*" both name the first block): every
    # repeated block then wears the same hook chain, so one compiled graph serves them all (a chain of two hooks
    # is a functools.partial where the others hold a bound method, and dynamo's guard on that compiles it apart)
    splits: dict[torch.nn.Module, tuple[str, dict]] = {}
    gathers: list[tuple[torch.nn.Module, ModelHook, str]] = []
    for module_id, spec in plan.cp_plan.items():
        for module in plan_modules(transformer, module_id):
            if isinstance(spec, dict):
                first_id, merged = splits.get(module, (module_id, {}))
                splits[module] = (first_id, {**merged, **spec})
            else:
                gathers.append((module, PlanGatherHook(ctx, state, spec), GATHER_HOOK.format(module_id)))
    state.text_last = plan.text_last
    return [(module, PlanSplitHook(ctx, state, spec, plan.image_input), SPLIT_HOOK.format(module_id))
            for module, (module_id, spec) in splits.items()] + gathers


def install(hooks: list[tuple[torch.nn.Module, ModelHook, str]]) -> None:
    for module, hook, name in hooks:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


__all__ = ["FORWARD_HOOK", "GATHER_HOOK", "SPLIT_HOOK", "ForwardHook", "PlanState", "install", "plan_hooks"]

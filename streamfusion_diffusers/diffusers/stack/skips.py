"""The cache's skip decision, agreed over the ranks by construction.

diffusers' First Block Cache decides at every transformer call whether to skip all blocks after the first, from
one number: the relative change of the first block's residual, mean|r_t - r_t-1| / mean|r_t-1|, against its
threshold. Under sequence parallelism each rank holds only its slice of the tokens and would compute its own
number; ranks on either side of the threshold would part, one running the remaining blocks (and their attention
collectives) while another skips them, and the job would stall until its timeout. `agree_skips` makes each head
hook compute both sums over its rank's slice and all-reduce them over the SP group (the ranks that share the
tokens: with CFG parallelism, the guidance branch's) before comparing: the counts of the two means cancel, so
every rank takes the decision one rank holding every token takes.

The other caches diffusers ships decide from the schedule alone and agree already: TaylorSeer (a call counter
and its interval), Pyramid Attention Broadcast (the timestep range and a call counter), MagCache (precomputed
magnitude ratios per step; its calibration mode measures per-rank means, but never skips). FasterCache filters
the unconditional branch in the frequency domain of the whole latent, which a token slice does not have: the
command line does not offer it.

`agree_skips` runs before every forward of a parallelized transformer (sharding.ForwardHook), so a cache enabled
before or after `parallelize` is covered. It replaces diffusers' decision on the hook instance only, after
checking that the hook still has the shape read here (diffusers 0.42): a changed hook fails loudly.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK, FBCHeadBlockHook, FBCSharedBlockState

from ...context import ParallelContext

DECISION = "_should_compute_remaining_blocks"  # FBCHeadBlockHook's method: (residual) -> run the other blocks


def check_hook() -> None:
    """The diffusers hook as read here: a decision method taking the residual, a threshold, and the previous
    residual on its shared state."""
    method = getattr(FBCHeadBlockHook, DECISION, None)
    names = list(inspect.signature(method).parameters) if method is not None else None
    state = FBCSharedBlockState()
    if names != ["self", "hidden_states_residual"] or not hasattr(state, "head_block_residual"):
        import diffusers

        raise RuntimeError(f"diffusers {diffusers.__version__} changed its First Block Cache hook "
                           f"(FBCHeadBlockHook.{DECISION}{'' if names is None else tuple(names)}): streamfusion cannot "
                           f"agree its skip decision over the ranks; use diffusers 0.42.x, or --cache taylorseer")


class AgreedDecision:
    """FBCHeadBlockHook's decision from the residual-change sums of every rank of the SP group."""

    def __init__(self, hook: FBCHeadBlockHook, ctx: ParallelContext):
        self.hook, self.ctx = hook, ctx

    @torch.compiler.disable
    def __call__(self, residual: torch.Tensor) -> bool:
        previous = self.hook.state_manager.get_state().head_block_residual
        if previous is None:  # the first call of a generation: every rank of the group is at the same call
            return True
        sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).double()
        group = self.ctx.cfg.sp
        if group.pg is not None:
            dist.all_reduce(sums, group=group.pg)
        change, base = sums.tolist()
        return change / base > self.hook.threshold


def lead_blocks(transformer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The first block of each of the transformer's block lists (its ModuleList children), where a First Block
    Cache puts its head hook; read once per transformer, not per forward."""
    return tuple(m[0] for m in transformer.children() if isinstance(m, torch.nn.ModuleList) and len(m))


def head_hooks(leads: Sequence[torch.nn.Module]) -> list[FBCHeadBlockHook]:
    """The First Block Cache head hooks on `leads` (`lead_blocks`)."""
    found = []
    for block in leads:
        registry = getattr(block, "_diffusers_hook", None)
        hook = registry.get_hook(_FBC_LEADER_BLOCK_HOOK) if registry is not None else None
        if hook is not None:
            found.append(hook)
    return found


def agree_skips(leads: Sequence[torch.nn.Module], ctx: ParallelContext) -> None:
    """Every First Block Cache on the transformer (given by its `lead_blocks`) decides from the metric reduced
    over ctx's SP group."""
    for hook in head_hooks(leads):
        agreed = hook.__dict__.get(DECISION)
        if not (isinstance(agreed, AgreedDecision) and agreed.ctx is ctx):
            check_hook()
            setattr(hook, DECISION, AgreedDecision(hook, ctx))


def release_skips(transformer: torch.nn.Module) -> None:
    """diffusers' own decision back (unparallelize: one rank holds every token again)."""
    for hook in head_hooks(lead_blocks(transformer)):
        hook.__dict__.pop(DECISION, None)


__all__ = ["AgreedDecision", "agree_skips", "lead_blocks", "check_hook", "head_hooks", "release_skips"]

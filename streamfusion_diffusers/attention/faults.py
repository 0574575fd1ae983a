"""Deliberate faults: proof that `streamfusion verify --self-test`'s exactness check can fail, and that a group
survives a rank out of memory.

A fault is a hook that a ParallelContext carries for one run (`ctx.fault`). Every schedule hands each ring step's
key/value blocks to `keys` before attending to them, and its output rows to `output`; a rank's worker tells it
each denoising step's end (`step_end`). The exact hook (`EXACT`, every normal run) hands everything back as it
is, so neither the algorithms nor the step loop hold fault branches. Each schedule fault makes the mistake a
broken schedule would make, and verify must then report a mismatch; `OutOfMemoryAt` fails a step as a GPU out
of memory would, and the group must stop the call on every rank and serve the next one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.config import Layout

KVBlock = tuple[Tensor, Tensor]


class Exact:
    """No fault: the key/value blocks and the output rows as the schedule made them."""

    name = "exact"

    def applies(self, layout: Layout, text: int) -> bool:
        """Whether the fault exists on `layout` with `text` joint tokens."""
        return True

    def keys(self, step: int, blocks: list[KVBlock], text: int) -> list[KVBlock]:
        """The blocks ring step `step` attends to (0: this rank's own set, >= 1: a peer's block as it arrives);
        the first `text` key rows of `blocks` are the joint (text) tokens."""
        return blocks

    def output(self, out: Tensor, rank: int) -> Tensor:
        """This rank's output rows [B, L, H, D] as sp_attention returns them."""
        return out

    def step_end(self, step: int) -> None:
        """A denoising step of a pipeline call ended on this rank, `step` steps done (runtime/worker.py)."""


EXACT = Exact()


class DropRingBlock(Exact):
    """The first peer block of every ring pass is never attended (a lost transfer)."""

    name = "ring K/V block dropped"

    def applies(self, layout: Layout, text: int) -> bool:
        return layout.ring > 1

    def keys(self, step: int, blocks: list[KVBlock], text: int) -> list[KVBlock]:
        return [] if step == 1 else blocks


class DropText(Exact):
    """The joint (text) keys are left out of every query's key set."""

    name = "text keys dropped"

    def applies(self, layout: Layout, text: int) -> bool:
        return text > 0

    def keys(self, step: int, blocks: list[KVBlock], text: int) -> list[KVBlock]:
        kept = []
        for k, v in blocks:
            cut = min(text, k.shape[1])
            kept.append((k[:, cut:], v[:, cut:]))
            text -= cut
        return kept


class CountTwice(Exact):
    """One key/value block is attended twice at ring step 0: this rank's own block beside the text keys, or
    the text keys where they share one block with every key (all keys twice would leave softmax unchanged)."""

    name = "K/V block counted twice"

    def applies(self, layout: Layout, text: int) -> bool:
        return layout.ring > 1 or layout.torus > 1 or text > 0

    def keys(self, step: int, blocks: list[KVBlock], text: int) -> list[KVBlock]:
        if step != 0 or not blocks:
            return blocks
        if len(blocks) == 1 and text > 0:
            k, v = blocks[0]
            return blocks + [(k[:, :text], v[:, :text])]
        return blocks + blocks[-1:]


class ShiftRows(Exact):
    """One rank's output rows come back shifted by one row (an off-by-one in the gather)."""

    name = "one rank's output rows shifted by one"

    def __init__(self, victim: int = 1):
        self.victim = victim

    def applies(self, layout: Layout, text: int) -> bool:
        return layout.world_size > self.victim

    def output(self, out: Tensor, rank: int) -> Tensor:
        return out.roll(1, dims=1) if rank == self.victim else out


class OutOfMemoryAt(Exact):
    """This rank runs out of GPU memory at the end of step `step` of every pipeline call."""

    name = "out of memory"

    def __init__(self, step: int):
        self.step = step

    def step_end(self, step: int) -> None:
        if step == self.step:
            raise torch.cuda.OutOfMemoryError(f"injected fault: out of memory at step {step}")


FAULTS = (DropRingBlock(), DropText(), CountTwice(), ShiftRows())  # verify --self-test's, each on every layout

__all__ = ["EXACT", "FAULTS", "CountTwice", "DropRingBlock", "DropText", "Exact", "OutOfMemoryAt", "ShiftRows"]

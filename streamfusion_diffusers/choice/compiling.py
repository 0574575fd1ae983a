"""Whether a job compiles its transformer's blocks when `--compile` is not given: from measured steps, like the
layout.

Compiled blocks replayed from the CUDA graph run a step faster than the graphed eager kernels (inductor fuses the
norms, modulation and activations between the GEMMs), and the first step pays for the compile. `generate`
compiles where the steps after its first save more than that. `serve` does not by default: its start-up would
take the compile, and so would its first request of each new size or batch (a stall of the same length while
the group holds every request behind it); `serve --compile` takes both for the faster step.

The figures are recorded runs (recipes/compiled.json, each read from its log under benchmarks/results/, which
tests/test_compile_choice.py checks): per model, ranks, size and GPU, the graphed step, the compiled-in-the-graph
step and the compile's seconds (the compiled run's first step less the graphed run's). A size or rank count
without a record takes the model's record nearest in the tokens a rank holds, its saving scaled by those
tokens; a model without a record does not compile by default (`--compile` asks anyway).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache

from .recipe import PACKAGED

COMPILED = "compiled.json"  # in the packaged recipes folder


@dataclass(frozen=True)
class CompiledRecord:
    """One measured pair of runs: the graphed eager kernels' step against the compiled blocks' in the graph."""

    model: str
    height: int
    width: int
    frames: int
    ranks: int
    tokens: int  # image tokens of the whole sequence (the model's `image_tokens` at this size)
    gpu: str  # the GPU kind it ran on (H100, H200)
    graph_step_s: float  # median step after the first, CUDA graphs on, eager kernels
    compiled_step_s: float  # the same with the repeated blocks compiled, replayed from the graph
    compile_s: float  # the compiled run's first step less the graphed run's
    record: str  # the log under benchmarks/results/ both runs are read from (generate's output)
    lines: tuple[int, int]  # which of its `generate` summary lines are the graphed run and the compiled run

    @property
    def saving_s(self) -> float:
        return self.graph_step_s - self.compiled_step_s

    def label(self) -> str:
        size = f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames > 1 else "")
        return (f"{self.model} {size} on {self.ranks} rank(s) of {self.gpu}: {1e3 * self.graph_step_s:.1f} -> "
                f"{1e3 * self.compiled_step_s:.1f} ms a step, {self.compile_s:.0f} s to compile")


@cache
def records() -> tuple[CompiledRecord, ...]:
    data = json.loads((PACKAGED / COMPILED).read_text())
    return tuple(CompiledRecord(**{**r, "lines": tuple(r["lines"])}) for r in data["records"])


def nearest(model: str, tokens: int, ranks: int) -> CompiledRecord | None:
    """The model's record nearest in the tokens a rank holds (ranks as near as can be on a tie); None: no record."""
    own = [r for r in records() if r.model == model]
    if not own:
        return None
    share = tokens / ranks
    return min(own, key=lambda r: (abs(math.log(share * r.ranks / r.tokens)), abs(math.log(ranks / r.ranks))))


def compile_pays(model: str, tokens: int, ranks: int, calls: int | None) -> tuple[bool, str]:
    """Whether compiling pays for `calls` steps after the first, and why; None: a server's steps, which never
    compile by default (its start and every new size or batch would wait for a compile)."""
    record = nearest(model, tokens, ranks)
    if record is None:
        return False, f"no compiled step of {model} measured (--compile to try it)"
    saving = record.saving_s * (tokens / ranks) / (record.tokens / record.ranks)
    if saving <= 0:
        return False, f"compiled blocks measured no faster ({record.label()})"
    if calls is None:
        return False, (f"a server would wait for the compile at its start and at each new size or batch "
                       f"({record.label()}); --compile to take it for the faster step")
    if calls * saving > record.compile_s:
        return True, f"{calls} steps save about {calls * saving:.1f} s, more than the compile ({record.label()})"
    return False, (f"{calls} steps would save about {calls * saving:.1f} s, less than the compile ({record.label()}); "
                   f"--compile to compile anyway")


__all__ = ["COMPILED", "CompiledRecord", "compile_pays", "nearest", "records"]

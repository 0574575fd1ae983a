"""The running attention state of one block of query rows, into which each key/value chunk's result merges.

Kept apart from the kernels that fill it: the algorithms hold their queries' Partials across ring steps and
stages, and the kernel choice times its candidates on clones of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .merge import merge_into


@dataclass
class Partial:
    """Running attention state of one block of query rows: the paper's (O', l, m) kept normalised, as
    out = O'/l (float32, contiguous [B, Lq, H, D]) and lse = m + ln l (float32 [B, H, Lq]).

    Once finalized, `out` holds the final output in the query dtype and no more chunks can be added.
    """

    out: Tensor | None = None
    lse: Tensor | None = None
    final: bool = False

    def add(self, out: Tensor, lse: Tensor) -> None:
        """Merge one chunk pair's (out, lse) into the state."""
        if self.final:
            raise RuntimeError("this attention state was finalized; no more key/value chunks can be merged")
        if self.out is None:
            acc = torch.float64 if out.dtype == torch.float64 else torch.float32
            self.out = torch.empty(out.shape, dtype=acc, device=out.device).copy_(out)
            self.lse = torch.empty(lse.shape, dtype=acc, device=lse.device).copy_(lse)
        else:
            merge_into(self.out, self.lse, out, lse)

    def finalize(self, dtype: torch.dtype) -> None:
        """Keep only the output, cast to dtype."""
        if self.out is not None:
            self.out = self.out.to(dtype)
            self.final = True

    def result(self, dtype: torch.dtype) -> Tensor:
        if self.out is None:
            raise RuntimeError("attention state was never updated: no key/value block reached these queries")
        return self.out.to(dtype)

    def clone(self) -> Partial:
        return Partial(None if self.out is None else self.out.clone(),
                       None if self.lse is None else self.lse.clone(), self.final)

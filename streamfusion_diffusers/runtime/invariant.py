"""Linear layers whose rows do not depend on the batch, on the CPU.

The CPU's BLAS multiplies a matrix of few rows by another kernel than one of many (a one-row timestep or pooled
text embedding is a matrix-vector product), and the kernels sum in different orders: an image's conditioning
then differs in the last bit between batch 1 and batch 4, and the image by one level in places. Padding every
linear's input to at least MIN_ROWS rows keeps each row on the many-row kernel, whose result per row does not
depend on how many rows there are, so a request's image is the same alone and in any batch (and `generate`,
which runs the same build, makes it too). The padding costs a few dozen rows of the smallest products.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

MIN_ROWS = 64  # the most rows any BLAS kernel choice here was seen to depend on was 55 (AVX2), 15 (AVX-512)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_ROWS or rows == 0:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
    return F.linear(padded, module.weight, module.bias)[:rows].reshape(*x.shape[:-1], -1)


def rows_invariant(pipe: Any) -> int:
    """Make every nn.Linear of the pipeline's modules batch-invariant (above); the number changed."""
    changed = 0
    for part in pipe.components.values():
        if isinstance(part, torch.nn.Module):
            for module in part.modules():
                if type(module) is torch.nn.Linear:
                    module.forward = _linear.__get__(module)
                    changed += 1
    return changed


__all__ = ["MIN_ROWS", "rows_invariant"]

"""Linear layers whose rows do not depend on the batch, on the CPU.

The CPU's BLAS multiplies a matrix of few rows by another kernel than one of many (a one-row timestep or pooled
text embedding is a matrix-vector product), and the kernels sum in different orders: an image's conditioning
then differs in the last bit between batch 1 and batch 4, and the image by one level in places. Padding every
linear's input to at least MIN_ROWS rows keeps each row on the many-row kernel, whose result per row does not
depend on how many rows there are, so a request's image is the same alone and in any batch (and `generate`,
which runs the same build, makes it too). The padding costs a few dozen rows of the smallest products. The VAE's
convolutions also choose their kernel by batch, so a batch is decoded one latent at a time.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

MIN_ROWS = 64  # above the row counts at which the CPU BLAS kernels seen here still switch (AVX2 and AVX-512 alike)


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows >= MIN_ROWS or rows == 0:
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[1])])
    return F.linear(padded, module.weight, module.bias)[:rows].reshape(*x.shape[:-1], -1)


def _one_at_a_time(decode: Any) -> Any:
    def decode_each(z: torch.Tensor, *args: Any, return_dict: bool = True, **kwargs: Any) -> Any:
        if z.shape[0] == 1:
            return decode(z, *args, return_dict=return_dict, **kwargs)
        sample = torch.cat([decode(z[i:i + 1], *args, return_dict=False, **kwargs)[0] for i in range(z.shape[0])])
        if not return_dict:
            return (sample,)
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample)

    return decode_each


def rows_invariant(pipe: Any) -> int:
    """Make every nn.Linear of the pipeline's modules batch-invariant, and its VAE decode one latent at a time
    (above); the number of linears changed."""
    if getattr(pipe, "vae", None) is not None:
        pipe.vae.decode = _one_at_a_time(pipe.vae.decode)
    changed = 0
    for part in pipe.components.values():
        if isinstance(part, torch.nn.Module):
            for module in part.modules():
                if type(module) is torch.nn.Linear:
                    module.forward = _linear.__get__(module)
                    changed += 1
    return changed


__all__ = ["MIN_ROWS", "rows_invariant"]

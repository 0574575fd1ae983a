"""Flux's rotary embedding of Q and K: diffusers' `apply_rotary_emb`, in one Triton pass where it can run.

The pass (triton_rotary.py) gives diffusers' numbers bit for bit; it runs on CUDA tensors of the shapes Flux
makes (q and k alike, [B, S, H, D] with D / 2 a power of two, real float32 tables [S, D]) outside torch.compile,
which fuses diffusers' own code itself. Anything else runs diffusers' function, and so does every call after the
pass failed to build on this GPU (said once).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

from ..core.logs import say_once
from .optional import has_triton, is_build_error

logger = logging.getLogger(__name__)
_unbuilt: set[torch.device] = set()  # the devices where the pass failed to build: diffusers' function there

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rotary_qk(q: Tensor, k: Tensor, freqs: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """`apply_rotary_emb(x, freqs, sequence_dim=1)` of q and of k ([B, S, H, D]; freqs: (cos, sin))."""
    cos, sin = freqs
    if q.device not in _unbuilt and _fits(q, k, cos, sin):
        try:
            return _one_pass()(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())
        except Exception as err:
            if not is_build_error(err):
                raise
            _unbuilt.add(q.device)
            say_once(logger, logging.WARNING, "RoPE in one pass did not build on %s (%s): diffusers' "
                     "apply_rotary_emb runs instead", q.device, str(err).splitlines()[0][:200])
    apply_rotary_emb = _diffusers()
    return apply_rotary_emb(q, freqs, sequence_dim=1), apply_rotary_emb(k, freqs, sequence_dim=1)


@cache  # imported once: this runs at every block
def _one_pass() -> Callable[..., tuple[Tensor, Tensor]]:
    from .triton_rotary import rotary_qk_triton

    return rotary_qk_triton


@cache  # diffusers is imported only to run (the kernels import without it)
def _diffusers() -> Callable[..., Tensor]:
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb


def _fits(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether the Triton pass computes exactly what diffusers' function would for these inputs."""
    if torch.compiler.is_compiling() or not (q.is_cuda and has_triton()):  # compiled: before the cached probe
        return False
    half = q.shape[-1] // 2 if q.dim() == 4 and q.shape[-1] % 2 == 0 else 0
    return (q.shape == k.shape and q.dtype == k.dtype and q.dtype in _DTYPES and half > 0 and half & (half - 1) == 0
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (q.shape[1], q.shape[3]))


__all__ = ["rotary_qk"]

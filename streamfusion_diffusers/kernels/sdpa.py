"""GPU attention with log-sum-exp through PyTorch's fused SDPA kernels (cuDNN, then flash, then efficient).

Each aten op returns the natural-log LSE as float32 [B, H, Lq] (the efficient kernel pads Lq to a multiple
of 32, older cuDNN builds add a trailing dim of 1): the result is cut back to [B, H, Lq].
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.logs import say_once
from .dispatch import pinned, time_ms
from .state import current

logger = logging.getLogger(__name__)

BACKENDS = ("cudnn", "flash", "efficient")
# How torch's SDPA kernels answer "not for this input" (their TORCH_CHECKs, and cuDNN frontend's plan search): the
# GPU, build, dtype, head dim or lengths are outside what the backend takes. Anything else is a real failure.
UNSUPPORTED = (
    "only support",  # flash: "FlashAttention only supports Ampere GPUs or newer", "... only support fp16 and bf16"
    "is only supported on",  # flash: "bfloat16 is only supported on Ampere GPUs or newer"
    "supports head dimension",  # flash: "FlashAttention forward only supports head dimension at most 256"
    "must be a multiple of",  # flash: "head_size must be a multiple of 8"
    "not enabled for build",  # "USE_FLASH_ATTENTION was not enabled for build." (and USE_MEM_EFF_ATTENTION)
    "no execution plans support the graph",  # cuDNN frontend: no engine for this graph
    "not supported", "not_supported",  # cuDNN: "... is not supported", CUDNN_STATUS_NOT_SUPPORTED
    "no available kernel",  # F.scaled_dot_product_attention with no backend left for the input
    "could not run",  # NotImplementedError: the op has no kernel for this device in this build
)
# (backend, device, dtype, q shape, k shape) that a backend refused: a capability of this GPU and torch build for
# that input, not a choice, so module-level as the other probes; other shapes still try the backend first.
_unsupported: set[tuple] = set()


def _call(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float, lse: bool = True) -> tuple[Tensor, Tensor]:
    """q, k, v in [B, H, L, D]; returns the op's raw (out, lse); lse=False asks for none where the kernel can skip
    it (cuDNN, efficient: flash always writes it) and returns an undefined one."""
    aten = torch.ops.aten
    if backend == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, False, False, scale=scale)
    elif backend == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    else:
        res = aten._scaled_dot_product_efficient_attention(q, k, v, None, lse, 0.0, False, scale=scale)
    return res[0], res[1]


def attention_no_lse(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] -> out [B, Lq, H, D] by one named SDPA backend, without the
    log-sum-exp: what a rank's share costs with no merge to feed (the bench's no-communication bound)."""
    out, _ = _call(backend, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, lse=False)
    return out.transpose(1, 2)


def attention_masked(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float) -> Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D], key_mask [B, Lk] (True: attend) -> out [B, Lq, H, D], no log-sum-exp:
    padded keys (a batch of prompts of different lengths) left out of every query's softmax, by PyTorch's SDPA
    with a boolean mask (the fused and flash kernels take none)."""
    mask = key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2)


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] -> out [B, Lq, H, D], no log-sum-exp (for queries that see every key at
    once: nothing merges after them), by the fastest SDPA backend for these shapes and strides on this GPU.

    The backends differ up to 2x (flash against cuDNN on Hopper: benchmarks/kernel_table.py) and PyTorch's own
    pick depends on its version and the GPU, so each backend is timed once per shape (dispatch.time_ms), kept in
    the running call's KernelState, and the fastest runs from then on; while a CUDA graph is captured an untimed
    shape takes the first backend that runs it, as every shape does when the choices are pinned (dispatch.pin).
    Ranks time alone: their picks can differ only where the times
    are within noise, which is also all that a differing pick can cost. Off CUDA: PyTorch's default SDPA."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=scale).transpose(1, 2)
    # the shapes and strides spelled out, not a generator: this runs at every call
    key = (q.device, q.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride())
    state = current()
    if key not in state.no_lse:
        capturing, pin = torch.cuda.is_current_stream_capturing(), pinned()
        times: dict[str, float] = {}
        for backend in BACKENDS:
            try:
                if capturing or pin:  # the first backend that runs it, untimed
                    out = attention_no_lse(backend, q, k, v, scale)
                    if pin:
                        state.no_lse[key] = backend
                    return out
                times[backend] = time_ms(lambda: None, lambda _, b=backend: attention_no_lse(b, q, k, v, scale))
            except RuntimeError as err:
                if not unsupported(err):
                    raise
        if not times:
            raise RuntimeError(f"no SDPA backend of {list(BACKENDS)} takes attention of q {list(q.shape)}, k "
                               f"{list(k.shape)} {q.dtype} on this GPU; use kernel='reference'")
        state.no_lse[key] = min(times, key=times.get)
        say_once(logger, logging.INFO, "attention without log-sum-exp for q %s, k %s: %s (%s)", list(q.shape),
                 list(k.shape), state.no_lse[key], ", ".join(f"{b} {ms:.3f} ms" for b, ms in times.items()))
    return attention_no_lse(state.no_lse[key], q, k, v, scale)


def attention_with_lse_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float,
                            backends: Sequence[str] = BACKENDS) -> tuple[Tensor, Tensor]:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] on CUDA -> (out [B, Lq, H, D] in q.dtype, lse [B, H, Lq] float32).

    Tries the given backends in order. One that answers "not supported for this input" (`unsupported`) is skipped
    for this input's shape and dtype from then on, said once; any other error (a CUDA fault, a bad argument) is
    raised, and the backend stays first for every shape. Running out of memory is raised with the sizes.
    """
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    shape = (q.device, q.dtype, q.shape, k.shape)
    for backend in backends:
        if (backend, *shape) in _unsupported:
            continue
        try:
            out, lse = _call(backend, qt, kt, vt, scale)
        except torch.OutOfMemoryError as err:
            raise torch.OutOfMemoryError(
                f"SDPA backend {backend} ran out of GPU memory for attention of {q.shape[1]} queries over "
                f"{k.shape[1]} keys ({q.shape[0]} x {q.shape[2]} heads of {q.shape[3]}, {q.dtype}): spread the "
                f"sequence over more ranks (a longer ring holds less K/V), lower the batch, or free memory "
                f"first ({err})") from err
        except RuntimeError as err:
            if not unsupported(err):
                raise
            _unsupported.add((backend, *shape))
            say_once(logger, logging.WARNING, "SDPA backend %s does not take q %s, k %s %s (%s); the next backend "
                     "runs this shape", backend, list(q.shape), list(k.shape), q.dtype,
                     str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__)
            continue
        if lse.dim() == 4:
            lse = lse.squeeze(-1)
        return out.transpose(1, 2), lse[..., : q.shape[1]].float()
    raise RuntimeError(f"no SDPA backend of {list(backends)} takes attention of q {list(q.shape)}, k "
                       f"{list(k.shape)} {q.dtype} with the log-sum-exp on this GPU; use kernel='reference'")


def unsupported(err: RuntimeError) -> bool:
    """Whether an SDPA backend's error says it does not take this input (UNSUPPORTED), not that it failed. A CUDA
    error ("CUDA error: operation not supported ..." included) is a fault of the device or the launch: never."""
    text = str(err).lower()
    if isinstance(err, torch.AcceleratorError) or "cuda error" in text:
        return False
    return any(phrase in text for phrase in UNSUPPORTED)

"""The one error measure of the project: how far an attention output is from exact softmax attention.

Every check (verify, bench rows, tune, layer_bench, the tests) measures the same thing: the relative error
||out - ref|| / ||ref|| over the whole output (the squared norms summed over every rank where the output is
split), against a reference computed by an independent path: softmax attention written out in torch,
(q @ k^T * scale).softmax() @ v, in float64 on the CPU and float32 on GPUs, never the kernel under test.

A relative norm does not shrink with the output as sequences grow (attention outputs do: they average more
values), so the same threshold holds at 1k and at 64k tokens. The thresholds are per input dtype and no more
than 5x the honest error measured at that dtype (`HONEST`): the rounding of a correct schedule passes, a dropped
block of keys, dropped text keys or a block counted twice fail.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# Largest honest relative error measured on the CPU over every method and layout (benchmarks/exactness_cpu.py
# and the attention test matrix; 1 and 4 gloo ranks, 11 to 16,384 image tokens + 0 to 512 text tokens, 4 to
# 48 heads of 16 to 128; the table of benchmarks/results/2026-11-24-h200-fused-tuning/README.md). Half precision
# is the output's own rounding (every method alike); float32 is summation order. Threshold = MARGIN x that, MARGIN at most 5.
HONEST = {torch.float32: 6.05e-7, torch.float16: 2.14e-4, torch.bfloat16: 1.68e-3}
MARGIN = 5.0
THRESHOLD = {dtype: MARGIN * err for dtype, err in HONEST.items()}

# A transformer block or step against the unparallelized model in the same dtype (not attention against an
# exact reference): two roundings of every projection and norm, summed in two orders, through every block.
MODEL_THRESHOLD = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

# Our methods over 1-byte transfers (--comm-dtype int8 / fp8): lossy by design, checked by this relative bound at
# every level, with room over the rounding each codec was measured to add (the low-precision study:
# benchmarks/results/2026-11-23-h200x2-pm/README.md).
LOWP_THRESHOLD = 5e-2


def threshold(dtype: torch.dtype) -> float:
    """The largest relative error an exact attention schedule may show with inputs of `dtype`."""
    if dtype not in THRESHOLD:
        raise ValueError(f"no exactness threshold for {dtype}; inputs are float32, float16 or bfloat16")
    return THRESHOLD[dtype]


def reference_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                        budget_bytes: int = 2**28) -> Tensor:
    """Softmax attention of q [B, Lq, H, D] over k, v [B, Lk, H, D], written out in torch: float64 on the CPU,
    float32 on a GPU; query rows a block at a time so the score matrix stays under `budget_bytes`.

    The independent path every check compares with: no log-sum-exp, no merge, no kernel of this package."""
    dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, lq, h, _ = q.shape
    kt, vt = k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)  # [B, H, Lk, D]
    step = max(1, budget_bytes // (b * h * k.shape[1] * torch.finfo(dtype).bits // 8))
    out = torch.empty((b, lq, h, v.shape[-1]), dtype=dtype, device=q.device)
    for start in range(0, lq, step):
        qt = q[:, start:start + step].to(dtype).transpose(1, 2)
        out[:, start:start + step] = ((qt @ kt.transpose(-1, -2)) * scale).softmax(-1).matmul(vt).transpose(1, 2)
    return out


def error_sums(out: Tensor, ref: Tensor) -> tuple[float, float]:
    """(||out - ref||^2, ||ref||^2) in float64: what ranks add up before the ratio is taken."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} differs from the reference's {tuple(ref.shape)}")
    ref = ref.double()
    return (out.double() - ref).pow(2).sum().item(), ref.pow(2).sum().item()


def relative_error(out: Tensor, ref: Tensor, group: dist.ProcessGroup | None = None, *,
                   distributed: bool = False) -> float:
    """||out - ref|| / ||ref||; with `distributed`, over every rank's rows of `group` (collective)."""
    diff, norm = error_sums(out, ref)
    if distributed:
        device = out.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        sums = torch.tensor([diff, norm], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        diff, norm = sums.tolist()
    return ratio(diff, norm)


def ratio(diff: float, norm: float) -> float:
    """sqrt(diff / norm) from summed squares; an all-zero reference counts any difference as infinite."""
    if norm == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return (diff / norm) ** 0.5


def passes(err: float, dtype: torch.dtype) -> bool:
    """Whether relative error `err` is within the exactness threshold of `dtype` (NaN never passes)."""
    return err <= threshold(dtype)


__all__ = ["HONEST", "MARGIN", "MODEL_THRESHOLD", "THRESHOLD", "error_sums", "passes", "ratio",
           "reference_attention", "relative_error", "threshold"]

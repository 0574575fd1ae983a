"""`--quantize int8|fp8`: torchao weight-only quantization of every Linear layer of the transformers (extra
`quantize`). The attention and its transfers are untouched: sequence parallelism splits activations, and each
rank holds the whole (quantized) weights. fp8 needs float8 matmuls (compute capability 8.9 or newer)."""
from __future__ import annotations

import torch


def quantize(transformers: list[torch.nn.Module], kind: str) -> str:
    """Weight-only int8 or float8 (e4m3) weights with per-channel scales, in place; what ran."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig()
    for transformer in transformers:
        quantize_(transformer, config)
    return f"{kind} weight-only (torchao {type(config).__name__})"


__all__ = ["quantize"]

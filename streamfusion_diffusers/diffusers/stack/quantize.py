"""`--quantize`: torchao quantization of every Linear layer of the transformers (extra `quantize`).

int8 and fp8 are weight-only: they save memory, and the matmuls still run in the activations' dtype. fp8-dynamic
quantizes the activations too, per row at every call, so the matmuls run on float8 tensor cores: the one that
saves time (compute capability 8.9 or newer). The attention and its transfers are untouched: sequence
parallelism splits activations, and each rank holds the whole (quantized) weights."""
from __future__ import annotations

import torch


def quantize(transformers: list[torch.nn.Module], kind: str) -> str:
    """Quantize in place: int8 or float8 (e4m3) weights with per-channel scales, or (fp8-dynamic) float8 weights
    and activations with per-row scales; returns what ran."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig,
                                      Int8WeightOnlyConfig, PerRow, quantize_)

    config, what = {"int8": (Int8WeightOnlyConfig, "weight-only"), "fp8": (Float8WeightOnlyConfig, "weight-only"),
                    "fp8-dynamic": (lambda: Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
                                    "float8 weights and activations")}[kind]
    config = config()
    for transformer in transformers:
        quantize_(transformer, config)
    return f"{kind} {what} (torchao {type(config).__name__})"


__all__ = ["quantize"]

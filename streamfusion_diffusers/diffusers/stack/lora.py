"""`--lora PATH[:SCALE]`: LoRAs loaded by diffusers' `load_lora_weights` (peft), weighted by `set_adapters` and
fused into the weights, so a step costs what it cost without them and quantization sees plain Linear layers.

Loading before or after `parallelize` gives the same result: the LoRA wraps the projection layers, which the
sequence-parallel attention calls as the stock processors do.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .spec import Lora


def load_loras(pipe: Any, loras: tuple[Lora, ...]) -> list[dict]:
    """Load, weight and fuse each LoRA; what ran, as run.json says it."""
    names = [f"lora{i}" for i in range(len(loras))]
    for name, lora in zip(names, loras):
        path = Path(lora.path)
        if path.is_dir():
            pipe.load_lora_weights(str(path), adapter_name=name)
        else:
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
    pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])
    pipe.fuse_lora(adapter_names=names, lora_scale=1.0)
    pipe.unload_lora_weights()  # the peft layers go; the fused weights stay
    return [{"path": lora.path, "scale": lora.scale} for lora in loras]


__all__ = ["load_loras"]

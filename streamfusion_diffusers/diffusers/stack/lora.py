"""`--lora PATH[:SCALE]`: LoRAs loaded by diffusers' `load_lora_weights` (peft), weighted by `set_adapters` and
fused into the weights, so a step costs what it costs without them. `--lora NAME=PATH[:SCALE]`: a named adapter
loaded the same way but left unfused and off; each generation turns on the ones its request picks
(`use_adapters`), a change of host-side flags and scaling floats on every rank, without a collective.

Loading before or after `parallelize` gives the same result: the LoRA wraps the projection layers, which the
sequence parallelism never touches (it works on the attention's inputs and outputs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .spec import Lora

Choice = tuple[tuple[str, float], ...]  # the named adapters a generation runs, with their weights; () for none


def _load(pipe: Any, lora: Lora, name: str) -> None:
    path = Path(lora.path)
    if path.is_dir():
        pipe.load_lora_weights(str(path), adapter_name=name)
    else:
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)


def load_loras(pipe: Any, loras: tuple[Lora, ...]) -> list[dict]:
    """Load, weight and fuse each LoRA; what ran, as run.json says it."""
    names = [f"lora{i}" for i in range(len(loras))]
    for name, lora in zip(names, loras):
        _load(pipe, lora, name)
    pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])
    pipe.fuse_lora(adapter_names=names, lora_scale=1.0)
    pipe.unload_lora_weights()  # the peft layers go; the fused weights stay
    return [{"path": lora.path, "scale": lora.scale} for lora in loras]


def load_adapters(pipe: Any, adapters: tuple[Lora, ...]) -> list[dict]:
    """Load each named adapter unfused, then turn them all off (a generation turns on its own); what was loaded."""
    for lora in adapters:
        _load(pipe, lora, str(lora.name))
    pipe.disable_lora()
    return [{"name": lora.name, "path": lora.path, "scale": lora.scale} for lora in adapters]


def use_adapters(pipe: Any, choice: Choice) -> None:
    """Run the next calls with exactly the adapters of `choice` at their weights; () turns every adapter off
    (each LoRA layer then returns its base layer's output as is: the same pixels as without the adapters)."""
    if not choice:
        pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in choice], adapter_weights=[weight for _, weight in choice])


__all__ = ["Choice", "load_adapters", "load_loras", "use_adapters"]

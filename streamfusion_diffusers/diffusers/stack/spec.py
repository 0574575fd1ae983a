"""What a job stacks on its pipeline besides the parallelism, as the command line says it, checked before any
process starts: a cache (`--cache first-block:0.2`), LoRAs (`--lora PATH[:SCALE]`, repeatable: fused into the
weights; `--lora NAME=PATH[:SCALE]`: kept as a named adapter, unfused, that a request picks) and quantization
(`--quantize int8|fp8|fp8-dynamic`). Each bad value is one line naming the fix."""
from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.extras import missing

LORA_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes into a folder
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # no ":" (a request says "name:scale") and no "="
QUANTIZE = ("int8", "fp8", "fp8-dynamic")
FP8_CAPABILITY = (8, 9)  # float8 matmuls: Ada and Hopper or newer


@dataclass(frozen=True)
class CacheKind:
    """One of diffusers' cache hooks as `--cache NAME[:VALUE]` offers it: what VALUE means, its default, type and
    bound (integers: at least it; numbers: above it)."""

    value: str
    default: float
    integer: bool
    smallest: float
    families: tuple[str, ...] | None = None  # the model families it has what it needs for (None: every one)


CACHES = {
    # the relative change of the first block's residual below which the other blocks are skipped
    "first-block": CacheKind("threshold", 0.05, False, 0.0),
    # a full step every INTERVAL steps, the others predicted by a Taylor series of the attention outputs
    "taylorseer": CacheKind("interval", 5, True, 1),
    # the accumulated magnitude-ratio error below which a step is skipped; diffusers ships Flux.1's ratios only
    "magcache": CacheKind("threshold", 0.06, False, 0.0, families=("flux",)),
    # Pyramid Attention Broadcast: the self-attention computed every N-th call within timesteps 100..800
    "pab": CacheKind("every", 2, True, 2),
}


@dataclass(frozen=True)
class Cache:
    name: str
    value: float
    steps: int  # the job's denoising steps (MagCache interpolates its ratios to them)

    def __str__(self) -> str:
        return f"{self.name}:{self.value:g}"


@dataclass(frozen=True)
class Lora:
    path: str  # a .safetensors file, or the folder save_lora_weights wrote
    scale: float = 1.0  # fused: the weight it is fused with; named: the weight a request gets unless it gives one
    name: str | None = None  # None: fused into the weights; else a named adapter left unfused


@dataclass(frozen=True)
class Stack:
    """What every rank stacks on the pipeline (picklable: it travels in the Job)."""

    cache: Cache | None = None
    loras: tuple[Lora, ...] = ()  # fused into the weights, for every generation
    quantize: str | None = None
    adapters: tuple[Lora, ...] = ()  # named, unfused: each generation runs the ones its request picks


def parse_cache(spec: str, family: str, steps: int) -> Cache:
    """`NAME[:VALUE]`, NAME one of CACHES, VALUE within its range; a cache the model lacks data for refused."""
    name, _, text = spec.partition(":")
    kind = CACHES.get(name)
    if kind is None:
        raise ValueError(f"--cache {spec}: unknown cache {name!r}; one of {', '.join(CACHES)} "
                         f"(e.g. first-block:0.2)")
    if kind.families is not None and family not in kind.families:
        raise ValueError(f"--cache {name}: diffusers ships its magnitude ratios for Flux.1 only; use first-block "
                         f"or taylorseer with this model")
    try:
        value = (int if kind.integer else float)(text) if text else kind.default
    except ValueError:
        value = math.nan
    too_small = value < kind.smallest if kind.integer else value <= kind.smallest
    if not math.isfinite(value) or too_small:
        bound = f"at least {kind.smallest:g}" if kind.integer else f"above {kind.smallest:g}"
        number = "an integer" if kind.integer else "a number"
        raise ValueError(f"--cache {spec}: the {kind.value} must be {number} {bound} "
                         f"(e.g. {name}:{kind.default:g})")
    return Cache(name, value, steps)


def parse_lora(spec: str) -> Lora:
    """`[NAME=]PATH[:SCALE]`: a local LoRA file or folder (hub ids are not fetched here), SCALE a finite number,
    NAME letters, digits, '.', '_' and '-' (a path that exists as given is a path, '=' and all)."""
    name = None
    if "=" in spec and not Path(spec).expanduser().exists():
        name, _, spec = spec.partition("=")
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"--lora {name}={spec}: the name {name!r} must be 1 to 64 letters, digits, '.', '_' or "
                             f"'-' (e.g. --lora style={spec})")
    path, scale = spec, 1.0
    if not Path(spec).expanduser().exists() and ":" in spec:
        path, _, text = spec.rpartition(":")
        try:
            scale = float(text)
        except ValueError:
            scale = math.nan
        if not math.isfinite(scale):
            raise ValueError(f"--lora {spec}: the scale {text!r} is not a finite number; PATH[:SCALE], "
                             f"e.g. {path}:0.8")
    found = Path(path).expanduser()
    if found.is_dir() and not (found / LORA_FILE).is_file():
        raise ValueError(f"--lora {path}: the folder holds no {LORA_FILE}; name the LoRA's .safetensors file")
    if not found.exists():
        raise ValueError(f"--lora {path}: no such file or folder; give a local LoRA .safetensors file or the "
                         f"folder save_lora_weights wrote (hub ids are not fetched here)")
    return Lora(str(found.absolute()), scale, name)


def check_quantize(quantize: str, gpu: bool) -> None:
    """torchao present; fp8 only where float8 matmuls run (this machine's first GPU stands for the job's)."""
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"--quantize {quantize} {missing('torchao')}")
    if quantize.startswith("fp8") and (not gpu or torch.cuda.get_device_capability() < FP8_CAPABILITY):
        raise ValueError(f"--quantize {quantize} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                         f"Blackwell); use --quantize int8 here")


def parse_stack(cache: str | None, loras: list[str] | None, quantize: str | None, *, family: str, steps: int,
                gpu: bool) -> Stack:
    """The command line's stack, every value checked (one line each, naming the fix)."""
    if loras and importlib.util.find_spec("peft") is None:
        raise ValueError(f"--lora {missing('peft')}")
    if quantize is not None:
        check_quantize(quantize, gpu)
    parsed = [parse_lora(spec) for spec in loras or ()]
    adapters = tuple(lora for lora in parsed if lora.name is not None)
    names = [lora.name for lora in adapters]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"--lora {twice}=...: the name is given twice; give each LoRA its own name")
    if adapters and quantize is not None:
        raise ValueError(f"--quantize {quantize} with named LoRAs (--lora NAME=PATH) is not supported: fuse them "
                         f"(--lora PATH) or drop --quantize")
    return Stack(cache=parse_cache(cache, family, steps) if cache is not None else None,
                 loras=tuple(lora for lora in parsed if lora.name is None), quantize=quantize, adapters=adapters)


__all__ = ["CACHES", "Cache", "Lora", "QUANTIZE", "Stack", "parse_stack"]

"""Which 1-byte transfers keep an attention layer within the bf16 bar: the study behind backends/quantized.py.

One process, CPU, float64 attention of L tokens x H heads x D (bf16 inputs) against the same with some kinds of
chunk (Q, K, V, O) sent through a codec, each kind travelling in full (a Torus over T machines moves (T-1)/T of
each kind, so its error is about sqrt((T-1)/T) x these). Codecs: the transport's own (backends/quantized.py:
per-row scales, Hadamard rotation on or off), e5m2, and one scale per chunk ("per layer", as xDiT's FP8 calibrates).
Inputs: Gaussian; Q and K with four channels 10 x the rest (a DiT's); logits 3 x sharper. Prints a markdown table.

    python benchmarks/lowp_study.py [--tokens 4096] [--heads 2] [--head-dim 128]
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from streamfusion_diffusers.backends.quantized import CODECS, Codec, hadamard

E5M2 = Codec(torch.float8_e5m2, torch.finfo(torch.float8_e5m2).max)
# (name, codec, one scale per chunk instead of per row, kinds that travel in 1 byte)
VARIANTS = [
    ("fp8 e4m3", dataclasses.replace(CODECS["fp8"], rotate=False), False, "qkvo"),
    ("fp8 e4m3 + Hadamard", CODECS["fp8"], False, "qkvo"),
    ("fp8 e4m3 + Hadamard, per-layer scale", CODECS["fp8"], True, "qkvo"),
    ("fp8 e5m2 + Hadamard", E5M2, False, "qkvo"),
    ("fp8 e4m3 + Hadamard, Q K only (V, O bf16)", CODECS["fp8"], False, "qk"),
    ("fp8 e4m3, Q V O (K bf16, as Cache-DiT)", dataclasses.replace(CODECS["fp8"], rotate=False), False, "qvo"),
    ("fp8 e4m3 + Hadamard, Q only", CODECS["fp8"], False, "q"),
    ("int8", dataclasses.replace(CODECS["int8"], rotate=False), False, "qkvo"),
    ("int8 + Hadamard (the transport's default)", CODECS["int8"], False, "qkvo"),
]


def _round_trip(x: torch.Tensor, codec: Codec, per_layer: bool) -> torch.Tensor:
    if not per_layer:
        return codec.decode(codec.encode(x), torch.empty_like(x))
    h = hadamard(x.shape[-1], x.device).double()
    rows = x @ h
    scale = rows.abs().max() / codec.top
    values = (rows / scale).float()
    values = values.round().to(codec.dtype) if not codec.dtype.is_floating_point else values.to(codec.dtype)
    return (values.double() * scale) @ h


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _inputs(kind: str, tokens: int, heads: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, heads, d, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "outlier channels":
        for x in (q, k):
            x[..., :4] *= 10
            x.mul_(0.5)
    elif kind == "3x sharper":
        q = q * 3
    return [x.to(torch.bfloat16).double() for x in (q, k, v)]


def _saved(kinds: str, per_layer: bool, d: int) -> float:
    """Share of the bf16 bytes saved: Q, K, V and O are equal volumes; each 1-byte kind sends 1 + 4/D bytes a value
    (the per-row float32 scale) instead of 2."""
    per_value = 1.0 if per_layer else 1.0 + 4.0 / d
    return len(kinds) / 4 * (1 - per_value / 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    kinds_of_input = ("Gaussian", "outlier channels", "3x sharper")
    data = {kind: _inputs(kind, args.tokens, args.heads, args.head_dim) for kind in kinds_of_input}
    refs = {kind: _attention(*qkv) for kind, qkv in data.items()}
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    print(f"{args.tokens} tokens x {args.heads} heads x {args.head_dim}, every listed kind travelling in full\n")
    print("| variant | bf16 bytes saved | " + " | ".join(f"rel err, {k}" for k in kinds_of_input) + " |")
    print("|---|---:|" + "---:|" * len(kinds_of_input))
    bf16 = [rel(refs[k].to(torch.bfloat16).double(), refs[k]) for k in kinds_of_input]
    print("| bf16 (the output rounded once) | 0 % | " + " | ".join(f"{e:.1e}" for e in bf16) + " |")
    for name, codec, per_layer, kinds in VARIANTS:
        errs = []
        for kind in kinds_of_input:
            q, k, v = (_round_trip(x, codec, per_layer) if c in kinds else x for x, c in zip(data[kind], "qkv"))
            out = _attention(q, k, v)
            errs.append(rel(_round_trip(out, codec, per_layer) if "o" in kinds else out, refs[kind]))
        print(f"| {name} | {100 * _saved(kinds, per_layer, args.head_dim):.1f} % | "
              + " | ".join(f"{e:.1e}" for e in errs) + " |")


if __name__ == "__main__":
    main()

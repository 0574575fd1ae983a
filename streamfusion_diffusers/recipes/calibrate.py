"""Fit the cost model to `streamfusion tune`'s measurements, for the recipe header that `method="auto"` reads.

Two steps. The attention rate per head size comes straight from the no-communication bound rows (each rank's
L/P x L attention, nothing moved). Then the fixed costs the model cannot derive from bytes and FLOPs, the
launch of each attention call, each posted group of transfers (a stage) and each layer, are fitted by least
squares on the relative error over every measured layout (Gauss-Newton: the model is piecewise linear in
them), kept non-negative.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

import numpy as np

from ..bench.costmodel import Gpu, predict
from ..bench.workloads import Workload
from .choose import Cluster, entry_layout

FITTED = ("launch_us", "stage_us", "layer_us")


def attention_rates(records: list[dict]) -> dict[int, float]:
    """TFLOP/s per head dim from the bound rows: 4 B (L/P) L H D FLOPs in the measured median."""
    rates: dict[int, list[float]] = {}
    for r in records:
        if r["kind"] == "bound" and r["ms"] > 0:
            p = r["machines"] * r["gpus_per_machine"]
            flops = 4.0 * r["batch"] * (r["tokens"] / p) * r["tokens"] * r["heads"] * r["head_dim"]
            rates.setdefault(r["head_dim"], []).append(flops / (r["ms"] * 1e-3) / 1e12)
    return {d: round(statistics.median(v), 3) for d, v in sorted(rates.items())}


def predicted_ms(r: dict, gpu: Gpu) -> float:
    w = Workload(r.get("workload", "record"), r["tokens"], 0, r["heads"], r["head_dim"], 1, batch=r["batch"])
    cluster = Cluster(r["machines"], r["gpus_per_machine"], r["link"])
    return predict(entry_layout(r, r["heads"]), w, cluster.inter, gpu, r.get("elem_bytes", 2)).layer_ms


def _residuals(records: list[dict], gpu: Gpu) -> np.ndarray:
    return np.array([predicted_ms(r, gpu) / r["ms"] - 1 for r in records])


def _rms(x: np.ndarray) -> float:
    return float(math.sqrt(np.mean(np.square(x)))) if len(x) else 0.0


def fit(records: list[dict], base: Gpu | None = None, rounds: int = 6) -> dict:
    """The calibration mapping for a recipe header (Gpu field names, plus how well it fits)."""
    rates = attention_rates(records)
    gpu = replace(base or Gpu(), attention_tflops=rates) if rates else (base or Gpu())
    layers = [r for r in records if r["kind"] == "layer" and r["ms"] > 0]
    out: dict = {"attention_tflops": dict(gpu.attention_tflops)}
    if not layers:
        return out
    theta = np.array([getattr(gpu, name) for name in FITTED], dtype=float)
    at = lambda t: replace(gpu, **dict(zip(FITTED, map(float, t))))  # noqa: E731
    before = residual = _residuals(layers, gpu)
    best = (_rms(residual), theta)
    for _ in range(rounds):
        step = 1.0  # microseconds; the model is piecewise linear, so a finite difference is its slope
        jacobian = np.stack([(_residuals(layers, at(theta + step * np.eye(len(FITTED))[i])) - residual) / step
                             for i in range(len(FITTED))], axis=1)
        delta = np.linalg.lstsq(jacobian, -residual, rcond=None)[0]
        theta = np.maximum(theta + delta, 0.0)
        residual = _residuals(layers, at(theta))
        if _rms(residual) < best[0] - 1e-9:
            best = (_rms(residual), theta)
        else:
            break
    rms, theta = best
    final = _residuals(layers, at(theta))
    out.update({name: round(float(v), 3) for name, v in zip(FITTED, theta)})
    out.update({"fitted_on": f"{len(layers)} measured layouts", "rms_error_before": round(_rms(before), 4),
                "rms_error": round(rms, 4), "max_error": round(float(np.max(np.abs(final))), 4)})
    return out

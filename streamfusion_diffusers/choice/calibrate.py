"""Fit the cost model to `streamfusion tune`'s measurements, for the recipe header that `method="auto"` reads.

Two steps. The attention rate per head size comes straight from the no-communication bound rows (each rank's
L/P x L attention, nothing moved). Then the fixed costs the model cannot derive from bytes and FLOPs, the
launch of each attention call, each posted group of transfers (a stage) and each layer, are fitted by least
squares on the relative error over every measured layout (Levenberg-Marquardt: the model is piecewise linear in
them, so a plain Gauss-Newton step overshoots at the kinks and stalls), kept non-negative.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace

import numpy as np

from .costmodel import Gpu, predict
from .workloads import Workload
from .choose import Cluster, entry_layout

# fitted fixed costs: (name, finite-difference step, lower bound, upper bound)
FITTED = (("launch_us", 1.0, 0.0, None), ("stage_us", 1.0, 0.0, None), ("layer_us", 1.0, 0.0, None),
          ("inter_latency_us", 1.0, 0.0, None), ("overlap", 0.01, 0.0, 1.0))


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


def _gpu(base: Gpu, theta: np.ndarray, dims: list[int]) -> Gpu:
    fixed = {name: float(v) for (name, *_), v in zip(FITTED, theta)}
    return replace(base, **fixed, attention_tflops={d: float(v) for d, v in zip(dims, theta[len(FITTED):])})


def fit(records: list[dict], base: Gpu | None = None, rounds: int = 30) -> dict:
    """The calibration mapping for a recipe header (Gpu field names, plus how well it fits).

    Parameters: the fixed costs in FITTED and the attention rate per head dim the timed layouts reach (their
    kernels split and merge where the bound makes one call), started from the bound's rates."""
    rates = attention_rates(records)
    gpu = replace(base or Gpu(), attention_tflops={**(base or Gpu()).attention_tflops, **rates})
    layers = [r for r in records if r["kind"] == "layer" and r["ms"] > 0]
    out: dict = {"attention_tflops": dict(gpu.attention_tflops)}
    if not layers:
        return out
    dims = sorted(gpu.attention_tflops)
    steps = np.array([f[1] for f in FITTED] + [1.0] * len(dims))
    low = np.array([f[2] for f in FITTED] + [1.0] * len(dims))
    high = np.array([np.inf if f[3] is None else f[3] for f in FITTED] + [np.inf] * len(dims))
    theta = np.array([getattr(gpu, f[0]) for f in FITTED] + [gpu.attention_tflops[d] for d in dims], dtype=float)
    before = residual = _residuals(layers, gpu)
    rms, damping = _rms(residual), 1e-3
    for _ in range(rounds):
        # the model is piecewise linear in each parameter, so a finite difference is its slope
        jacobian = np.stack([(_residuals(layers, _gpu(gpu, theta + steps[i] * np.eye(len(theta))[i], dims))
                              - residual) / steps[i] for i in range(len(theta))], axis=1)
        normal, gradient = jacobian.T @ jacobian, jacobian.T @ residual
        while damping < 1e8:  # damp a step that does not lower the error until it does (towards the gradient)
            delta = np.linalg.lstsq(normal + damping * np.diag(np.diag(normal)), -gradient, rcond=None)[0]
            trial = np.clip(theta + delta, low, high)
            trial_residual = _residuals(layers, _gpu(gpu, trial, dims))
            if _rms(trial_residual) < rms - 1e-9:
                damping /= 3
                break
            damping *= 4
        else:
            break
        theta, residual, rms = trial, trial_residual, _rms(trial_residual)
    fitted = _gpu(gpu, theta, dims)
    out = {"attention_tflops": {d: round(r, 3) for d, r in fitted.attention_tflops.items()},
           **{f[0]: round(getattr(fitted, f[0]), 4) for f in FITTED}}
    out.update({"fitted_on": f"{len(layers)} measured layouts", "rms_error_before": round(_rms(before), 4),
                "rms_error": round(rms, 4), "max_error": round(float(np.max(np.abs(residual))), 4)})
    return out


def host_per_block(records: list, blocks: dict[str, int]) -> dict[str, float]:
    """Seconds the host takes to issue one transformer block on the eager path, per model, from the records whose
    step waits on the host (their step is the host's time: the GPU idles between its kernels)."""
    per: dict[str, list[float]] = {}
    for r in records:
        if r.path == "eager" and r.bound == "host":
            per.setdefault(r.model, []).append(r.step_s / (r.calls * blocks[r.model]))
    return {m: statistics.mean(v) for m, v in sorted(per.items())}


"""The cost model fitted to real device measurements: the emulated layouts of BENCHMARKS.md (nvidia-h200-x4)
and the bench runs kept under benchmarks/results (nvidia-h200-x2) are predicted closer after the fit, and the
predictions table reads both kinds of files. The packaged H100 calibration predicts every emulated-machine layout
measured on H100s within the bar, as `plan` prints it, and `auto` picks the fastest measured there."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from streamfusion_diffusers.bench.records import records_from_bench
from streamfusion_diffusers.choice.calibrate import fit, predicted_ms
from streamfusion_diffusers.choice.choose import (
    Cluster,
    choose,
    entry_layout,
    gpu_of,
    schedule_key,
)
from streamfusion_diffusers.choice.costmodel import Gpu, predict
from streamfusion_diffusers.choice.predictions import load_records, table
from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.choice.workloads import cogvideox, flux
from streamfusion_diffusers.core.config import ParallelConfig, resolve_layout
from streamfusion_diffusers.core.links import PRESETS, parse_link

RESULTS = Path(__file__).parent.parent / "benchmarks" / "results" / "2026-11-22-h200x2"
# one layer on 4 x H100 (2 x 2, 4 x 1) and 2 x H100 (2 x 1), the p4de link emulated, torch transport
H100 = Path(__file__).parent.parent / "benchmarks" / "results" / "2026-11-27-h100-records-s39"
H100_NAME = "NVIDIA H100 80GB HBM3"
PLANNED = {"flux-dev 4096x4096": flux(4096), "cogvideox-5b 161f 768x1360": cogvideox(161)}  # as `plan` sizes them
WITHIN = 0.10  # the bar for every layout
FLUX, COG = (66048, 24, 128), (167508, 48, 64)  # Flux 4096 px, CogVideoX 161 frames: padded tokens, heads, dim
# BENCHMARKS.md, "Emulated machines on nvidia-h200-x4" (NVSHMEM): (N, M, link, workload, method, U, R, T, ms)
X4 = [(4, 1, "p4de", FLUX, "bound", 1, 1, None, 20.6), (4, 1, "p4de", FLUX, "usp", 4, 1, None, 70.9),
      (4, 1, "p4de", FLUX, "torus", 4, 1, 4, 58.8), (4, 1, "p4de", COG, "bound", 1, 1, None, 206.8),
      (4, 1, "p4de", COG, "usp", 2, 2, None, 274.4), (4, 1, "p4de", COG, "torus", 4, 1, 4, 209.8),
      (4, 1, "dgx", FLUX, "usp", 1, 4, None, 22.6), (4, 1, "dgx", COG, "usp", 1, 4, None, 200.8),
      (2, 2, "p4de", FLUX, "usp", 2, 2, None, 54.9), (2, 2, "p4de", FLUX, "torus", 2, 2, 2, 42.0),
      (2, 2, "p4de", COG, "usp", 2, 2, None, 202.0), (2, 2, "dgx", FLUX, "usp", 1, 4, None, 22.95),
      (2, 2, "dgx", COG, "usp", 1, 4, None, 199.0)]


def x4_records() -> list[dict]:
    return [dict(device="NVIDIA H200 (x4)", kind="bound" if meth == "bound" else "layer", machines=n,
                 gpus_per_machine=m, link=link, backend="nvshmem", tokens=w[0], heads=w[1], head_dim=w[2], batch=1,
                 method=meth, ulysses=u, ring=r, torus=t, ms=ms) for n, m, link, w, meth, u, r, t, ms in X4]


def test_fit_on_the_emulated_x4_measurements():
    records = x4_records()
    calibration = fit(records)
    assert calibration["rms_error"] < 0.07 < calibration["rms_error_before"]
    # 0.1265 since Ulysses sends Q, K and V as one message per peer: these layers were measured when they went as
    # three (fewer messages modelled than were sent, so the link's latency per message fits a little worse)
    assert calibration["max_error"] < 0.13
    usp = next(r for r in records if (r["machines"], r["method"], r["tokens"]) == (2, "usp", FLUX[0]))
    before, after = predicted_ms(usp, Gpu()), predicted_ms(usp, gpu_of(calibration))
    # 44.0 -> 48.0, within 13% of 54.9 ms, measured when Q, K and V crossed as three messages per peer (49.2,
    # within 11%, while the model counted them so)
    assert before < 0.82 * usp["ms"] and abs(after / usp["ms"] - 1) < 0.13


def test_fit_on_the_x2_bench_results_and_the_table():
    records = load_records([str(p) for p in sorted(RESULTS.glob("*/results.json"))], records_from_bench)
    layers = [r for r in records if r["kind"] == "layer"]
    assert len(layers) >= 80 and {r["link"] for r in layers} == {"real", "p4de", "dgx"}
    calibration = fit(records)
    assert calibration["rms_error"] < 0.035 < 0.08 < calibration["rms_error_before"]
    assert calibration["max_error"] < 0.13 and 0.0 <= calibration["overlap"] <= 1.0
    text = table(records)
    assert text.count("\n| 2 x 1 | p4de |") == sum(r["link"] == "p4de" for r in layers)
    assert "### Cost model vs measured, NVIDIA H200" in text


def test_fixed_costs_and_overlap_move_the_prediction_the_right_way():
    w = flux(4096)
    lay = resolve_layout(ParallelConfig(machines=2, gpus_per_machine=1, method="usp", ulysses=1), 2, w.heads)
    base = predict(lay, w, PRESETS["p4de"]).layer_ms
    serial = predict(lay, w, PRESETS["p4de"], replace(Gpu(), overlap=0.0)).layer_ms
    slow = predict(lay, w, PRESETS["p4de"], replace(Gpu(), inter_latency_us=1000.0)).layer_ms
    assert serial > base and abs(slow - base - 3.0) < 1e-6  # three messages cross: a ring step's K and V, the text


def h100_layers() -> list[dict]:
    records = load_records([str(p) for p in sorted(H100.glob("*/results.json"))], records_from_bench)
    return [r for r in records if r["kind"] == "layer"]


def test_plan_predicts_every_h100_layout_within_the_bar():
    layers = h100_layers()
    assert len(layers) == 14 and {r["device"] for r in layers} == {H100_NAME}
    gpu = gpu_of(load_recipe("flux-dev").calibration_for(H100_NAME))
    errors = {f"{r['workload']} {r['machines']}x{r['gpus_per_machine']} {entry_layout(r, r['heads'])}":
              predict(entry_layout(r, r["heads"]), PLANNED[r["workload"]], parse_link(r["link"]), gpu).layer_ms
              / r["ms"] - 1 for r in layers}
    assert max(map(abs, errors.values())) < WITHIN, errors


def test_auto_picks_the_fastest_measured_h100_layout():
    timed: dict[tuple, list[dict]] = {}
    for r in h100_layers():
        if r["machines"] * r["gpus_per_machine"] == 4:
            timed.setdefault((r["workload"], r["machines"], r["gpus_per_machine"], r["link"]), []).append(r)
    assert len(timed) == 4
    for (workload, n, m, link), rows in timed.items():
        r = min(rows, key=lambda r: r["ms"])
        chosen = choose(PLANNED[workload], Cluster(n, m, link), gpu=H100_NAME).layout
        assert schedule_key(chosen) == schedule_key(entry_layout(r, r["heads"])), (workload, n, m, chosen)

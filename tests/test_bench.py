"""`streamfusion bench` end to end on 4 CPU processes: every method, every layout, xDiT's USP, the bound."""
from __future__ import annotations

import json

import pytest
import torch

from streamfusion_diffusers.bench.report import auto_summary, noisy
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.runtime.run import run_local
from streamfusion_diffusers.commands.timing import Stats, interleaved_ms
from streamfusion_diffusers.core.exactness import threshold


def test_bench_times_and_checks_every_layout(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--workloads", "custom:250:6:8:16", "--machines", "2", "--gpus-per-machine", "2",
               "--layouts", "all", "--iters", "2", "--warmup", "1", "--cpu", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    labels = {r["layout"] for r in rows}
    assert {"no-comm bound", "ulysses U4R1", "xdit-usp U4R1", "tas U2R2", "usp U1R4", "torus U4R1T2"} <= labels
    assert all(r["ok"] and 0 < r["min_ms"] <= r["ms"] <= r["max_ms"] for r in rows)
    checked = [r for r in rows if r["layout"] != "no-comm bound"]
    assert all(0 < r["rel_err"] <= threshold(torch.float32) for r in checked), checked  # measured, not zero
    assert result["setup"]["tokens"]["custom 250+6"] == 256
    assert (out / "table.md").read_text().count("| custom 250+6 |") == len(rows)
    assert (out / "plot.png").stat().st_size > 1000
    assert "x xdit-usp" in capsys.readouterr().out


def test_stats_spread_is_the_range_over_the_median():
    row = Stats.of([1.2, 0.9, 1.0, 1.05, 0.95]).row()  # median 1.0, range 0.9 - 1.2
    assert (row["ms"], row["min_ms"], row["max_ms"]) == (1.0, 0.9, 1.2) and row["spread"] == pytest.approx(0.3)


def test_workload_specs():
    assert parse_workload("flux-dev:2048").tokens == 128 * 128
    assert parse_workload("cogvideox-5b:49").tokens == 13 * 48 * 85
    with pytest.raises(ValueError, match="custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM"):
        parse_workload("sd3:1024")


def _call_order(iters: int, warmup: int) -> tuple[list[str], list]:
    import torch

    order: list[str] = []
    calls = [lambda name=name: order.append(name) for name in "abc"]
    return order, interleaved_ms(calls, iters, warmup, torch.device("cpu"), target_ms=0)


def test_repetitions_interleave_across_cases_and_noise_is_flagged():
    order, stats = run_local(_call_order, 1, 2, 1)[0]
    assert "".join(order) == "abcbcacab"  # one warm-up round, two timed rounds; each round starts one case later
    assert len(stats) == 3 and all(s.min <= s.median <= s.max and s.calls == 1 for s in stats)
    row = dict(workload="w", level="layer", layout="usp U2R2", ms=1.0, min_ms=0.97, max_ms=1.03, spread=0.06)
    assert "a spread of 6.0% (> 5%)" in noisy([row])[0] and noisy([{**row, "spread": 0.04}]) == []


def _batched(iters: int, warmup: int) -> tuple[list[int], list]:
    """A 0.3 ms call and a 5 ms call timed together on a fake host clock that each call advances by its
    duration: how often each ran, and their stats."""
    import types

    import torch

    from streamfusion_diffusers.commands import timing

    now, counts = [0.0], [0, 0]

    def call(i: int, seconds: float):
        def run():
            counts[i] += 1
            now[0] += seconds
        return run

    timing.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    return counts, interleaved_ms([call(0, 3e-4), call(1, 5e-3)], iters, warmup, torch.device("cpu"))


def test_short_calls_are_timed_in_batches_and_reported_per_call():
    counts, (short, long) = run_local(_batched, 2, 3, 1)[0]
    # a sample lasts >= 2 ms: 7 back-to-back calls of 0.3 ms, its time divided by 7; the 5 ms call alone
    assert (short.calls, long.calls) == (7, 1)
    assert short.min == short.max == pytest.approx(0.3) and long.median == pytest.approx(5.0)
    # warm-up 1, sizing (one call, then a batch of the estimate where it exceeds one), 3 samples of n calls
    assert counts == [1 + (1 + 7) + 3 * 7, 1 + 1 + 3]


def test_auto_summary_passes_within_two_percent_of_the_fastest_other_row():
    row = dict(workload="w", level="layer")
    rows = [{**row, "method": "auto", "layout": "auto (usp U2R2)", "ms": 1.01},
            {**row, "method": "usp", "layout": "usp U2R2", "ms": 1.0},
            {**row, "method": "xdit-usp", "layout": "xdit-usp U4R1", "ms": 1.2}]
    (line,) = auto_summary(rows)
    assert line.startswith("PASS w layer") and "(+1.0%)" in line and "xdit-usp U4R1 1.200 ms (-15.8%)" in line
    assert auto_summary([{**rows[0], "ms": 1.05}, *rows[1:]])[0].startswith("FAIL")


def test_the_bound_of_a_model_without_its_processors_is_refused_before_the_build():
    """MiniMax-H3 has neither the Flux.1 nor the CogVideoX bound processor, and gathers two outputs where the bound
    removes one: refused in one line before any model is built or any process group joined."""
    from streamfusion_diffusers.bench.layer import Case, Setup
    from streamfusion_diffusers.bench.model import ModelSetup, bench_model
    from streamfusion_diffusers.choice.workloads import Workload

    w = Workload("minimax-h3 124f", 1024, 0, 8, 16, blocks=1, model="minimax-h3")
    setup = ModelSetup(Setup(w, 1, 2, "torch", None, torch.float32, 1, 0, 0), {}, ("step",))
    with pytest.raises(ValueError, match="minimax-h3 has neither: time it without Case\\('bound'\\)$"):
        bench_model(setup, [Case("bound"), Case("ulysses")])

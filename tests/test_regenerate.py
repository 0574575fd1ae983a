"""Regenerating a recipe folder as the packaged one is: cost-model entries for every shape, then a real tune
run's output (2 gloo processes) merged in with `tune --merge-from`: the measured shape's entry becomes the
measured one, the others stay `source: cost model` and are predicted again with the calibration fitted from
the merged measurements."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamfusion_diffusers.choice.calibrate import fit
from streamfusion_diffusers.choice.choose import Cluster, gpu_of, ranked
from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.choice.regenerate import parse_shapes
from streamfusion_diffusers.choice.workloads import Workload
from streamfusion_diffusers.cli import main

WORKLOAD = "custom:250:6:8:16"
SHAPES = "1x2,1x4,2x2:p4de,2x2:dgx"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    assert main(["tune", "--cpu", "--workloads", WORKLOAD, "--machines", "1", "--gpus-per-machine", "2",
                 "--iters", "2", "--warmup", "1", "--out", str(out)]) == 0
    return out


def test_merge_replaces_the_measured_shape_and_repredicts_the_rest(tuned, tmp_path):
    packaged = tmp_path / "packaged"
    assert main(["tune", "--from-cost-model", "--workloads", WORKLOAD, "--shapes", SHAPES, "--out", str(packaged)]) == 0
    before = load_recipe(str(packaged / "custom.yaml"))
    assert before.calibration is None and len(before.entries) == 4
    assert {e["source"] for e in before.entries} == {"cost model"}
    assert {(e["machines"], e["gpus_per_machine"], e["link"]) for e in before.entries} == {
        (1, 2, "real"), (1, 4, "real"), (2, 2, "p4de"), (2, 2, "dgx")}

    assert main(["tune", "--merge-from", str(tuned), "--out", str(packaged)]) == 0
    after = load_recipe(str(packaged / "custom.yaml"))
    by_shape = {(e["machines"], e["gpus_per_machine"], e["link"]): e for e in after.entries}
    assert len(by_shape) == 4
    measured = load_recipe(str(tuned / "custom.yaml")).entries[0]
    assert by_shape[1, 2, "real"] == measured
    records = json.loads((packaged / "measurements.json").read_text())["records"]
    assert records == json.loads((tuned / "measurements.json").read_text())["records"]
    assert after.calibration == {"cpu": fit(records)} and after.calibration["cpu"]["attention_tflops"]
    w = Workload("custom", 250, 6, 8, 16, 1)
    for shape in ((1, 4, "real"), (2, 2, "p4de"), (2, 2, "dgx")):
        e = by_shape[shape]
        best = ranked(w, Cluster(*shape), gpu_of(after.calibration_for()))[0]
        assert e["source"] == "cost model" and e["predicted_ms"] == round(best.layer_ms, 4)
        assert (e["method"], e["ulysses"], e["ring"]) == (best.layout.method, best.layout.ulysses, best.layout.ring)

    # a cost-model pass afterwards never writes over the measured entry
    assert main(["tune", "--from-cost-model", "--workloads", WORKLOAD, "--shapes", "1x2", "--out", str(packaged)]) == 0
    again = {(e["machines"], e["gpus_per_machine"]): e for e in load_recipe(str(packaged / "custom.yaml")).entries}
    assert again[1, 2] == measured


def test_bad_shapes_and_sources_name_the_fix(tmp_path):
    assert parse_shapes("1x2,2x1:p4de,4x1:25:10", "real") == [(1, 2, "real"), (2, 1, "p4de"), (4, 1, "25:10")]
    assert parse_shapes("2x2", "dgx") == [(2, 2, "dgx")]
    with pytest.raises(ValueError, match="not like 2x8"):
        parse_shapes("2by8", "real")
    with pytest.raises(ValueError, match="neither a preset"):
        parse_shapes("2x1:fast", "real")
    with pytest.raises(SystemExit):  # the CLI turns the ValueError into a usage error
        main(["tune", "--merge-from", str(tmp_path), "--out", str(tmp_path / "out")])


def test_bench_results_calibrate_the_cost_model_entries(tmp_path):
    bench_out = Path(__file__).parent.parent / "benchmarks" / "results" / "2026-11-22-h200x2"
    assert main(["tune", "--from-cost-model", "--workloads", "flux-dev:4096", "--shapes", "2x1:p4de",
                 "--out", str(tmp_path)]) == 0
    assert main(["tune", "--merge-from", str(bench_out / "emu-p4de-flux-dev-4096"), "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "measurements.json").read_text())["records"]
    assert len(records) == 8 and {r["link"] for r in records} == {"p4de"}
    (entry,) = load_recipe(str(tmp_path / "flux-dev.yaml")).entries
    calibration = load_recipe(str(tmp_path / "flux-dev.yaml")).calibration_for("NVIDIA H200")
    assert calibration == fit(records) and entry["source"] == "cost model"
    best = ranked(Workload("flux", 65536, 512, 24, 128, 1), Cluster(2, 1, "p4de"), gpu_of(calibration))[0]
    assert entry["predicted_ms"] == round(best.layer_ms, 4)

"""`streamfusion plan --serve`: every replica split R x P/R of one machine for `streamfusion serve --replicas R`,
predicted from the cost model and the recorded generations (choice/replicas.py). The records are checked against
their files; the step prediction against recorded steps it was not fitted on; splits that do not fit are listed
with the reason; bad input is one line. CPU only, no process started."""
from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from streamfusion_diffusers.choice.choose import gpu_of
from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.choice.replicas import RECORDS, record_path, records_of, replica_shape, step_s
from streamfusion_diffusers.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPU = gpu_of(load_recipe("flux-dev").calibration_for())
WITHIN = 0.15  # predicted step against a recorded one the prediction was not fitted on
# a step that waits on the host: the host-bound rows of one job spread this much for the same work, and the host's
# speed varies more between jobs than the GPU's
WITHIN_HOST = 0.25
SERVED = "2026-11-26-h100x4-default-serve-s33/serve_gpu.json"  # a warm served 28-step flux-dev 1024 request, 1 x 4


def _phase(row: dict, name: str) -> float:
    return row["phases"][name]["median"]


def test_every_record_is_its_file():
    """Each figure of RECORDS is what its file under benchmarks/results holds (per step: the denoise over steps)."""
    for r in RECORDS:
        data = json.loads((ROOT / record_path(r)).read_text())
        if r.row in data:  # default_path_gpu.sh: a run's steady steps (3 onward)
            assert r.step_s == pytest.approx(statistics.median(data[r.row]["steps_s"][2:]), abs=1e-3)
            continue
        if "rows" not in data:  # a generate run.json: its warm (second) step and its phases
            assert (r.step_s, r.text_s, r.decode_s) == pytest.approx(
                (data["step_latency_s"][1], data["phases_s"]["text_encoding"], data["phases_s"]["decode"]), abs=0.01)
            continue
        steps = data["setup"].get("steps")
        row = next(x for x in data["rows"] if x.get("system", x.get("method")) == r.row
                   and x["workload"].endswith(f"{r.width}x{r.height}"))
        if "phases" in row:
            assert (r.step_s, r.text_s, r.decode_s) == pytest.approx(
                (_phase(row, "denoising") / steps, _phase(row, "text_encoding"), _phase(row, "decode")), abs=1e-3)
        else:  # bench --level step: one transformer forward, ms
            assert r.step_s == pytest.approx(row["ms"] / 1e3 * r.calls, abs=1e-3)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r.model}-P{r.ranks}-{r.path}-{r.bound}")
def test_at_a_records_own_size_and_ranks_the_step_is_the_record(record):
    """The calibration reproduces what it was fitted on: every one-GPU record, the one of several GPUs each model's
    serial share is fitted on, and the host's time per block where a record waited on the host."""
    assert record in records_of(record.model) or record.bound == "host", "a record nothing is fitted on"
    predicted, _ = step_s(record.model, record.frames, record.height, record.width, record.ranks, GPU,
                          graph=record.path == "graph")
    assert predicted == pytest.approx(record.step_s, rel=1e-6)


def test_the_step_meets_records_it_was_not_fitted_on():
    """benchmarks/plan_serve_check.py: each recorded step read from its file, eager and graphed, the prediction
    within WITHIN where it waits on the device and WITHIN_HOST where on the host (Qwen-Image 1024 at P = 2, eager)."""
    spec = importlib.util.spec_from_file_location("plan_serve_check", ROOT / "benchmarks" / "plan_serve_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rows = check.rows()
    assert len(rows) == 9 and {r["bound"] for r in rows} == {"device", "host"}, rows
    for r in rows:
        assert abs(r["predicted_over_measured"] - 1) <= (WITHIN if r["bound"] == "device" else WITHIN_HOST), r


def test_a_served_request_on_four_gpus_is_the_measured_one(capsys):
    """The plan's latency of one 28-step flux-dev 1024 request on one group of 4 (graphs, serve's default) against
    the warm served request measured on 4 x H100 (the HTTP round trip and the PNG are in the measured, not the plan)."""
    served = json.loads((ROOT / "benchmarks" / "results" / SERVED).read_text())[0]
    assert (served["model"], served["steps"], served["height"], served["world_size"]) == ("flux-dev", 28, 1024, 4)
    assert main(["plan", "--serve", "--json", "--gpus-per-machine", "4", "--model", "flux-dev", "--steps", "28"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["cuda_graph"]["on"] and plan["splits"][0]["ranks"] == 4
    assert plan["splits"][0]["latency_s"] == pytest.approx(served["latency_median_s"], rel=WITHIN)


def test_eager_steps_wait_on_the_host(capsys):
    """--no-cuda-graph: at 4 ranks a flux-dev 1024 step is the host's issue time, longer than the graphed step;
    sharded weights replay from graphs like whole ones."""
    argv = ["plan", "--serve", "--json", "--gpus-per-machine", "4", "--model", "flux-dev"]
    steps, graphs = [], []
    for flag in ([], ["--no-cuda-graph"], ["--shard-weights"]):
        assert main(argv + flag) == 0
        plan = json.loads(capsys.readouterr().out)
        steps.append(plan["splits"][0]["step_s"])
        graphs.append(plan["cuda_graph"]["on"])
    assert steps[1] > 1.5 * steps[0] and graphs == [True, False, True]


def test_table_for_flux_dev_on_four_gpus(capsys):
    assert main(["plan", "--serve", "--machines", "1", "--gpus-per-machine", "4", "--model", "flux-dev"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [r[:3] for r in rows] == [["1", "x", "4"], ["2", "x", "2"], ["4", "x", "1"]]
    assert "lowest latency: --replicas 1 (1 x 4)" in out and "most images per minute: --replicas 4 (4 x 1)" in out
    assert "e2e-flux/results.json" in out


@pytest.mark.parametrize("model, size, gpus", [
    ("flux-dev", ["--resolution", "2048"], 8), ("qwen-image", [], 4), ("wan2.2-ti2v-5b", ["--frames", "49"], 2),
])
def test_more_replicas_never_lower_the_latency(model, size, gpus, capsys):
    """Fewer ranks per group never make one request faster, and R groups never serve fewer per minute than one
    group of P: R x (P/R) = P, while a step at P/R is at least a step at P scaled by P/R's shorter share."""
    assert main(["plan", "--serve", "--json", "--machines", "1", "--gpus-per-machine", str(gpus), "--model", model,
                 *size]) == 0
    plan = json.loads(capsys.readouterr().out)
    splits = plan["splits"]
    assert [s["replicas"] for s in splits] == sorted(s["replicas"] for s in splits)
    latency = [s["latency_s"] for s in splits]
    assert latency == sorted(latency) and len(set(latency)) == len(latency)
    per_minute = [s["per_minute"] for s in splits]
    assert per_minute == sorted(per_minute)
    assert plan["lowest_latency"]["replicas"] == 1 and plan["most_per_minute"] == splits[-1]
    for s in splits:
        expected = s["text_s"] + plan["steps"] * s["step_s"] + s["decode_s"]
        assert s["latency_s"] == pytest.approx(expected, rel=1e-3)
        assert s["per_minute"] == pytest.approx(60 * s["replicas"] / s["latency_s"], rel=1e-3)


def test_a_split_that_does_not_fit_is_excluded_with_the_reason(capsys):
    """flux2-dev 1024 on 4 x 40 GB: only one group of 4 with sharded weights fits (31.8 GiB planned)."""
    assert main(["plan", "--serve", "--json", "--machines", "1", "--gpus-per-machine", "4", "--model", "flux2-dev",
                 "--gpu-memory", "40"]) == 0
    plan = json.loads(capsys.readouterr().out)
    by_r = {s["replicas"]: s for s in plan["splits"]}
    assert by_r[1]["weights"] == "sharded" and by_r[1]["excluded"] is None
    for r in (2, 4):
        assert by_r[r]["weights"] == "-" and "GiB per GPU whole" in by_r[r]["excluded"]
    assert plan["lowest_latency"]["replicas"] == plan["most_per_minute"]["replicas"] == 1
    main(["plan", "--serve", "--machines", "1", "--gpus-per-machine", "4", "--model", "flux2-dev", "--gpu-memory",
          "40"])
    out = capsys.readouterr().out
    assert "excluded: 2 x 2: needs" in out and "1 x 4 with --shard-weights" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny-flux"], "needs a recorded generation of tiny-flux"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--gpu-memory", "0.5"], "--gpu-memory 0.5: must be at least 1"),
    (["--model", "wan2.2-ti2v-5b", "--frames", "50"], "frames = 4k + 1"),
    (["--model", "flux2-dev", "--gpu-memory", "24"], "no split fits the GPU's memory: 1 x 4: needs"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    base = {"--machines": "1", "--gpus-per-machine": "4", "--model": "flux-dev"}
    given = dict(zip(argv[::2], argv[1::2]))
    args = [x for k, v in {**base, **given}.items() for x in (k, v)]
    with pytest.raises(SystemExit):
        main(["plan", "--serve", *args])
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_across_machines_every_split_serve_can_make_is_planned_and_a_group_spans_machines(capsys):
    assert main(["plan", "--serve", "--model", "flux-dev", "--machines", "2", "--gpus-per-machine", "4", "--json"]) == 0
    splits = json.loads(capsys.readouterr().out)["splits"]
    # serve's own split: 1 group of both machines, else groups inside one machine
    assert [(s["replicas"], s["ranks"], s["machines"]) for s in splits] == [(1, 8, 2), (2, 4, 1), (4, 2, 1),
                                                                            (8, 1, 1)]
    assert all(replica_shape(2, 4, s["replicas"]) == (s["machines"], s["ranks"] // s["machines"]) for s in splits)


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_split_is_predicted_at_the_layout_auto_runs(ranks):
    """The layout a group is predicted at is the one `method="auto"` runs there (a recipe entry, else the cost
    model ranked with the host's costs), not one that only the replayed costs would favour."""
    from streamfusion_diffusers.choice.choose import Cluster, choose, gpu_of
    from streamfusion_diffusers.choice.recipe import load_recipes
    from streamfusion_diffusers.choice.replicas import attention_s, workload_of

    recipe = next(r for r in load_recipes(None) if r.model == "flux-dev")
    w = workload_of("flux-dev", 1, 1024, 1024)
    _, label = attention_s(w, ranks, gpu_of(recipe.calibration_for("H100")))
    assert label == choose(w, Cluster(1, ranks), gpu="H100").layout.label


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "H100", "h100", "nvidia h100"])
def test_a_gpu_is_named_as_users_type_it(name):
    from streamfusion_diffusers.choice.recipe import gpu_kind

    assert gpu_kind(name) == "H100"

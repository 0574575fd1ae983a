"""`streamfusion tune` on a tiny workload (4 gloo processes as 2 x 2) writes a measured recipe that
`method="auto"` then reads: it picks the recorded layout, says why, and matches single-process attention."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.bench.layer import Case
from streamfusion_diffusers.choice.calibrate import fit
from streamfusion_diffusers.choice.choose import Cluster, choose, entry_layout
from streamfusion_diffusers.choice.recipe import load_recipe
from streamfusion_diffusers.choice.store import write_recipe
from streamfusion_diffusers.choice.workloads import Workload
from streamfusion_diffusers.bench import tune
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.core.sequence import split_sizes

WORLD, TOKENS, TEXT, HEADS, DIM = 4, 250, 6, 8, 16
ENTRY_KEYS = {"model", "tokens", "text_tokens", "heads", "head_dim", "machines", "gpus_per_machine", "link",
              "method", "ulysses", "ring", "backend", "kernel", "ms", "runner_up", "margin", "source", "device",
              "date"}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipes")
    rc = main(["tune", "--cpu", "--workloads", f"custom:{TOKENS}:{TEXT}:{HEADS}:{DIM}", "--machines", "2",
               "--gpus-per-machine", "2", "--top", "3", "--iters", "2", "--warmup", "1", "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def auto_attention(recipe: str, seed: int, joint: bool) -> tuple[float, list[str], int]:
    """sp_attention with method auto on fresh random inputs: (relative error against softmax attention,
    [layout chosen, why], shapes chosen for) after two calls."""
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(seed)
    text = TEXT if joint else 0
    q, k, v = (torch.randn(1, TOKENS + TEXT - text, HEADS, DIM, generator=g) for _ in range(3))
    jq, jk, jv = (torch.randn(1, text, HEADS, DIM, generator=g) for _ in range(3))
    lens = split_sizes(q.shape[1], WORLD)
    start = sum(lens[:rank])
    rows = slice(start, start + lens[rank])
    ctx = init_parallel(ParallelConfig(machines=2, gpus_per_machine=2, method="auto", recipe=recipe))
    kwargs = dict(joint_q=jq, joint_k=jk, joint_v=jv) if joint else {}
    local = [x[:, rows].contiguous() for x in (q, k, v)]
    for _ in range(2):
        out = sp_attention(*local, ctx, seq_lens=lens, **kwargs)
    full = [torch.cat([j, x], dim=1) for j, x in zip((jq, jk, jv), (q, k, v))]
    ref = reference_attention(*full)
    if joint:
        out, joint_out = out
        err = max(relative_error(out, ref[:, text:][:, rows]), relative_error(joint_out, ref[:, :text]))
    else:
        err = relative_error(out, ref[:, rows])
    (choice,) = ctx.chosen.values()
    return err, [str(choice.layout), choice.why], len(ctx.chosen)


def test_tune_writes_a_measured_recipe(tuned):
    doc = yaml.safe_load((tuned / "custom.yaml").read_text())
    (entry,) = doc["entries"]
    assert ENTRY_KEYS <= set(entry), ENTRY_KEYS - set(entry)
    assert entry["source"] == "measured" and entry["device"] == "cpu"
    assert (entry["machines"], entry["gpus_per_machine"], entry["tokens"]) == (2, 2, 250)
    assert entry["ms"]["min"] <= entry["ms"]["median"] <= entry["ms"]["max"] and entry["margin"] >= 0
    assert set(doc["calibration"]["cpu"]) >= {"attention_tflops", "launch_us", "stage_us", "layer_us", "rms_error"}
    records = json.loads((tuned / "measurements.json").read_text())["records"]
    timed = [r for r in records if r["kind"] == "layer"]
    assert len(timed) >= 3 and all(r["ms"] > 0 and r["predicted_ms"] > 0 for r in timed)
    assert any(r["method"] == "ulysses" for r in timed)  # plain Ulysses (= plain USP U4R1 here) is always timed


@pytest.mark.parametrize("joint", [False, True], ids=["text-in-sequence", "joint-text"])
def test_auto_picks_the_recorded_layout_and_matches_single_process(tuned, pool, joint):
    entry = load_recipe(str(tuned / "custom.yaml")).entries[0]
    for err, (layout, why), shapes in pool.run(auto_attention, str(tuned / "custom.yaml"), 7, joint):
        assert err <= threshold(torch.float32) and shapes == 1
        assert layout == str(entry_layout(entry, HEADS)) and why.startswith("recipe ") and "measured" in why


def test_auto_follows_an_edited_recipe_and_falls_back_to_the_cost_model(tuned, tmp_path, pool):
    entry = load_recipe(str(tuned / "custom.yaml")).entries[0]
    other = {"method": "torus", "ulysses": 2, "ring": 2, "torus": 2}
    if all(entry.get(k) == v for k, v in other.items()):
        other = {"method": "usp", "ulysses": 1, "ring": 4}
    edited = write_recipe(tmp_path / "custom.yaml", "custom", [{**entry, **other, "torus": other.get("torus")}])
    for err, (layout, _), _ in pool.run(auto_attention, str(edited), 8, False):
        assert err <= threshold(torch.float32) and layout.startswith(other["method"])
        assert f"U{other['ulysses']}R{other['ring']}" in layout
    shape = Workload("other heads", TOKENS, TEXT, 4, DIM, 1)
    choice = choose(shape, Cluster(2, 2), str(tuned / "custom.yaml"))
    assert choice.why.startswith("cost model (calibrated)") and choice.layout.world_size == 4


def test_merge_keeps_other_entries_and_calibration_fits(tuned, tmp_path):
    path = tmp_path / "custom.yaml"
    path.write_text((tuned / "custom.yaml").read_text())
    entry = load_recipe(str(path)).entries[0]
    bigger = {**entry, "tokens": 4 * TOKENS, "source": "cost model"}
    write_recipe(path, "custom", [bigger, {**entry, "source": "cost model", "method": "ring"}])
    entries = load_recipe(str(path)).entries
    assert len(entries) == 2 and [e["source"] for e in entries] == ["measured", "cost model"]  # measured kept
    records = json.loads((tuned / "measurements.json").read_text())["records"]
    calibration = fit(records)
    assert calibration["rms_error"] <= calibration["rms_error_before"]
    assert calibration["attention_tflops"][DIM] > 0
    with pytest.raises(ValueError, match="method 'auto' chooses ulysses"):
        ParallelConfig(method="auto", ulysses=2)


SPEC = f"custom:{TOKENS}:{TEXT}:{HEADS}:{DIM}"
INFO = {"machines": 2, "gpus_per_machine": 2, "link": "real", "backend": "torch", "kernel": "auto",
        "dtype": "float32", "device": "cpu", "date": "2026-11-24"}
FAST, SLOW = Case("usp", 2, 2), Case("usp", 4, 1)


def _row(case: Case, level: str, ms: float, rel_err: float) -> dict:
    return {"workload": "w", "level": level, "method": case.method, "layout": case.label, "ms": ms,
            "min_ms": ms, "max_ms": ms, "calls": 1, "rel_err": rel_err, "ok": rel_err <= threshold(torch.float32)}


def test_a_layout_that_is_not_exact_is_never_written_nor_calibrated():
    w = Workload("w", TOKENS, TEXT, HEADS, DIM, 2)
    rows = [_row(Case("bound"), "layer", 1.0, 0.0), _row(FAST, "layer", 2.0, 0.3), _row(SLOW, "layer", 3.0, 1e-7),
            _row(FAST, "block", 20.0, 0.3), _row(SLOW, "block", 30.0, 1e-7)]
    entry = tune._entry(SPEC, w, rows, [FAST, SLOW], INFO)
    assert (entry["ulysses"], entry["ring"]) == (4, 1) and "runner_up" not in entry, entry
    assert list(entry["block_ms"]) == [SLOW.label], entry
    records = tune._records(rows, {FAST: 2.0, SLOW: 3.0}, w, WORLD, INFO)
    assert sorted((r["kind"], r["ulysses"]) for r in records) == [("bound", 1), ("layer", 4)], records


def test_no_exact_layout_is_one_clear_error():
    w = Workload("w", TOKENS, TEXT, HEADS, DIM, 2)
    rows = [_row(FAST, "layer", 2.0, 0.3), _row(SLOW, "block", 30.0, 1e-7)]
    with pytest.raises(RuntimeError, match="no layout of w passed the exactness check"):
        tune._entry(SPEC, w, rows, [FAST, SLOW], INFO)

"""`streamfusion bench` end to end on 4 CPU processes: every method, every layout, xDiT's USP, the bound."""
from __future__ import annotations

import json

import pytest

from streamfusion_diffusers.bench.command import parse_workload
from streamfusion_diffusers.cli import main


def test_bench_times_and_checks_every_layout(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--workloads", "custom:250:6:8:16", "--machines", "2", "--gpus-per-machine", "2",
               "--layouts", "all", "--iters", "2", "--warmup", "1", "--cpu", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    labels = {r["layout"] for r in rows}
    assert {"no-comm bound", "ulysses U4R1", "xdit-usp U4R1", "tas U2R2", "usp U1R4", "torus U4R1T2"} <= labels
    assert all(r["ok"] and r["ms"] > 0 for r in rows)
    assert result["setup"]["tokens"]["custom 250+6"] == 256
    assert (out / "table.md").read_text().count("| custom 250+6 |") == len(rows)
    assert (out / "plot.png").stat().st_size > 1000
    assert "x xdit-usp" in capsys.readouterr().out


def test_workload_specs():
    assert parse_workload("flux-dev:2048").tokens == 128 * 128
    assert parse_workload("cogvideox-5b:49").tokens == 13 * 48 * 85
    with pytest.raises(ValueError, match="custom:TOKENS:TEXT_TOKENS:HEADS:HEAD_DIM"):
        parse_workload("sd3:1024")

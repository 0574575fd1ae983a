"""The cost model against the paper's volume formulas (Appendix D), and `streamfusion plan` end to end."""
from __future__ import annotations

import dataclasses
import json

import pytest

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.choice.costmodel import candidate_layouts, predict
from streamfusion_diffusers.choice.workloads import cogvideox, flux
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.core.config import resolve_layout
from streamfusion_diffusers.core.links import PRESETS, parse_link

W = flux(4096)
BLHD = W.batch * W.tokens * W.heads * W.head_dim  # text tokens travel with no all-to-all, only as a tiny gather
ELEM = 2


def inter_bytes(method: str, n: int, m: int, u: int, **kw) -> float:
    lay = resolve_layout(ParallelConfig(machines=n, gpus_per_machine=m, method=method, ulysses=u, **kw), n * m, 24)
    no_text = dataclasses.replace(W, text_tokens=0)
    return predict(lay, no_text, PRESETS["p4de"]).inter_machine_bytes_per_gpu


@pytest.mark.parametrize("n, m, u", [(2, 8, 8), (4, 8, 8), (8, 8, 8), (3, 8, 8)])
def test_usp_volume_is_appendix_d_eq4(n, m, u):
    # Eq. 4 with R = N (one ring peer per machine): 2 (N-1) BLHD / N per machine, i.e. / M per GPU
    assert inter_bytes("usp", n, m, u) == pytest.approx(2 * (n - 1) * BLHD / n / m * ELEM)


def test_direct_ring_spanning_machines_sends_each_block_to_every_remote_peer():
    # R = 8 ring peers on 4 machines, 2 per machine: 6 of the 7 blocks a rank sends cross machines
    block = 2 * BLHD / 8 / 4 * ELEM  # K and V of L/8 tokens, H/4 heads
    assert inter_bytes("usp", 4, 8, 4) == pytest.approx(6 * block)


@pytest.mark.parametrize("n, m, u", [(2, 8, 8), (4, 8, 8), (4, 8, 4), (3, 4, 6)])
def test_tas_and_torus_volume_is_appendix_d_eq6(n, m, u):
    # Eq. 6 (U >= N): 4 (N-1)/N BLHD / N, again per machine; Torus moves the same bytes, only overlapped
    expected = 4 * (n - 1) / n * BLHD / n / m * ELEM
    assert inter_bytes("tas", n, m, u) == pytest.approx(expected)
    assert inter_bytes("torus", n, m, u, torus=n) == pytest.approx(expected)


def test_torus_hides_what_tas_exposes_on_a_slow_link():
    lay = dict(machines=4, gpus_per_machine=8, ulysses=8)
    tas = resolve_layout(ParallelConfig(method="tas", **lay), 32, 24)
    torus = resolve_layout(ParallelConfig(method="torus", **lay), 32, 24)
    slow = parse_link("6.25:20")
    assert predict(torus, W, slow).layer_ms < 0.8 * predict(tas, W, slow).layer_ms
    assert predict(tas, W, slow).layer_ms > predict(tas, W, parse_link("50:5")).layer_ms


def test_candidates_respect_heads():
    assert [lay.ulysses for lay in candidate_layouts("tas", 4, 8, 48)] == [1, 2, 4, 8, 16]
    assert candidate_layouts("ulysses", 4, 8, 24) == []
    assert {lay.torus for lay in candidate_layouts("torus", 2, 4, 24) if lay.ulysses == 8} == {1, 2, 4, 8}


def test_plan_json(capsys):
    assert main(["plan", "--machines", "4", "--model", "cogvideox-5b", "--frames", "161", "--link", "p4de",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["methods"]) == {"ring", "usp", "tas", "torus"}  # 48 heads do not split over 32 ranks
    for entry in plan["methods"].values():
        assert {"ulysses", "ring", "inter_machine_bytes_per_gpu", "layer_ms", "step_ms"} <= set(entry)
        assert entry["ulysses"] * entry["ring"] == 32
    best = min(plan["methods"].values(), key=lambda e: e["step_ms"])
    assert plan["recommended"]["step_ms"] == best["step_ms"]
    assert cogvideox(161).tokens == 41 * 48 * 85


def test_plan_table_and_bad_link(capsys):
    assert main(["plan", "--machines", "2", "--resolution", "2048"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "usp" in out
    with pytest.raises(SystemExit):
        main(["plan", "--machines", "2", "--link", "fast"])
    assert "neither a preset" in capsys.readouterr().err

"""The one-machine Torus rule (choice/rules.py): its threshold is what the packaged measurements say (the
largest one-machine share at which Torus lost, plus one); method "auto"'s cost model leaves Torus out on one
machine below it, keeps it from there on and always across machines, and says so in the choice's reason."""
from __future__ import annotations

import json
from importlib.resources import files

import pytest

from streamfusion_diffusers.choice.workloads import Workload, cogvideox, flux
from streamfusion_diffusers.choice.choose import Cluster, choose, gpu_of, ranked
from streamfusion_diffusers.choice.rules import TORUS_MIN_TOKENS_PER_GPU, tokens_per_gpu


def _toruses(w: Workload, cluster: Cluster) -> list[str]:
    return [str(p.layout) for p in ranked(w, cluster, gpu_of(None)) if p.layout.torus > 1]


def test_the_threshold_is_derived_from_the_measurements():
    """Per one-machine shape measured (tune's layer records): Torus (T > 1) at its best against the best other
    layout. It lost at every share, so the rule starts above the largest."""
    records = json.loads(files("streamfusion_diffusers.choice").joinpath("recipes/measurements.json").read_text())
    best: dict[tuple, dict[bool, float]] = {}
    for r in records["records"]:
        if r["kind"] == "layer" and r["machines"] == 1:
            shape = (r["workload"], r["backend"], r["tokens"] / r["gpus_per_machine"])
            torus = (r["torus"] or 1) > 1
            mine = best.setdefault(shape, {})
            mine[torus] = min(mine.get(torus, float("inf")), r["ms"])
    lost = [share for (_, _, share), ms in best.items() if True in ms and False in ms and ms[True] > ms[False]]
    won = [share for (_, _, share), ms in best.items() if True in ms and False in ms and ms[True] <= ms[False]]
    assert len(lost) >= 6 and not won, (lost, won)
    assert TORUS_MIN_TOKENS_PER_GPU == max(lost) + 1


@pytest.mark.parametrize("w,gpus", [(flux(1024), 4), (flux(2048), 4), (flux(2048), 2), (cogvideox(49), 4),
                                    (flux(4096), 2), (cogvideox(161), 2), (cogvideox(161), 8)])
def test_shares_on_one_machine_up_to_the_measured_ones_rank_no_torus(w, gpus):
    assert tokens_per_gpu(w, gpus) < TORUS_MIN_TOKENS_PER_GPU
    assert _toruses(w, Cluster(1, gpus)) == []


def test_a_larger_share_on_one_machine_keeps_torus():
    w = Workload("custom", 2 * TORUS_MIN_TOKENS_PER_GPU, 0, 24, 128, 1)
    assert _toruses(w, Cluster(1, 2))


def test_across_machines_torus_stays_at_any_share():
    assert _toruses(flux(1024), Cluster(2, 4, "p4de"))


def test_the_threshold_is_the_boundary():
    just_below = Workload("custom", TORUS_MIN_TOKENS_PER_GPU * 2 - 2, 0, 24, 128, 1)
    at = Workload("custom", TORUS_MIN_TOKENS_PER_GPU * 2, 0, 24, 128, 1)
    assert _toruses(just_below, Cluster(1, 2)) == [] and _toruses(at, Cluster(1, 2))


def test_auto_says_why_torus_was_left_out(tmp_path):
    other = tmp_path / "other.yaml"  # an entry for another cluster only: the cost model decides
    other.write_text("model: flux-dev\nentries:\n- {machines: 2, gpus_per_machine: 8, resolution: 1024, "
                     "method: usp, ulysses: 8, ring: 2}\n")
    choice = choose(flux(1024), Cluster(1, 4), recipe=str(other))
    assert choice.layout.torus == 1
    assert f"Torus left out: one machine, 1152 tokens per GPU < {TORUS_MIN_TOKENS_PER_GPU}" in choice.why

"""`streamfusion bench --variants`: which cases each variant adds at each level, labels that keep variants apart,
and the clear refusals (unknown variant, CUDA graphs on the CPU). The variants' outputs are checked against the
unparallelized model by the bench itself (tests/test_compiled.py runs the compiled one)."""
from __future__ import annotations

import pytest

from streamfusion_diffusers.bench.layer import Case
from streamfusion_diffusers.bench.variants import parse_variants, with_variants
from streamfusion_diffusers.cli import main as cli_main

CASES = [Case("bound"), Case("usp", 2, 1), Case("xdit-usp", 2, 1), Case("diffusers-cp", 2, 1)]


def _names(cases: list[Case]) -> list[str]:
    return [c.label for c in cases]


def test_layer_level_adds_graph_rows_for_ours_and_the_bound_only():
    cases = with_variants(CASES, parse_variants("eager,cuda-graph,waves2,compile"), ("layer",))
    assert _names(cases) == ["no-comm bound", "no-comm bound +cuda-graph", "usp U2R1", "usp U2R1 +cuda-graph",
                             "xdit-usp U2R1", "diffusers-cp U2R1"]


def test_step_level_runs_every_variant_of_ours_and_no_waves_bound():
    cases = with_variants(CASES, parse_variants("cuda-graph,waves2,compile"), ("step",))
    assert _names(cases) == ["no-comm bound", "no-comm bound +cuda-graph", "no-comm bound +compile",
                             "usp U2R1 +cuda-graph", "usp U2R1 +waves2", "usp U2R1 +compile", "xdit-usp U2R1",
                             "diffusers-cp U2R1"]
    assert [c.name for c in cases[3:6]] == ["usp+cuda-graph", "usp+waves2", "usp+compile"]


def test_unknown_variant_names_the_choices():
    with pytest.raises(ValueError, match="choose from eager, cuda-graph, waves2, compile"):
        parse_variants("eager,graphs")


def test_cuda_graph_variant_is_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--cpu", "--variants", "eager,cuda-graph"])
    assert exit_info.value.code == 2
    assert "drop it from --variants" in capsys.readouterr().err

"""`streamfusion bench --variants`: which cases each variant adds at each level, labels that keep variants apart,
and the clear refusals (unknown variant, CUDA graphs on the CPU). The variants' outputs are checked against the
unparallelized model by the bench itself (tests/test_compiled.py runs the compiled one)."""
from __future__ import annotations

import json

import pytest
import torch

from streamfusion_diffusers.bench.layer import Case
from streamfusion_diffusers.bench.variants import VARIANTS, parse_variants, with_variants
from streamfusion_diffusers.cli import main as cli_main

CASES = [Case("bound"), Case("usp", 2, 1), Case("xdit-usp", 2, 1), Case("diffusers-cp", 2, 1)]


def _names(cases: list[Case]) -> list[str]:
    return [c.label for c in cases]


def test_layer_level_adds_graph_rows_for_ours_and_the_bound_only():
    cases = with_variants(CASES, parse_variants("eager,cuda-graph,compile"), ("layer",))
    assert _names(cases) == ["no-comm bound", "no-comm bound +cuda-graph", "usp U2R1", "usp U2R1 +cuda-graph",
                             "xdit-usp U2R1", "diffusers-cp U2R1"]


def test_step_level_runs_every_variant_of_ours_and_the_bound():
    cases = with_variants(CASES, parse_variants("cuda-graph,compile"), ("step",))
    assert _names(cases) == ["no-comm bound", "no-comm bound +cuda-graph", "no-comm bound +compile",
                             "usp U2R1 +cuda-graph", "usp U2R1 +compile", "xdit-usp U2R1", "diffusers-cp U2R1"]
    assert [c.name for c in cases[3:5]] == ["usp+cuda-graph", "usp+compile"]


def test_unknown_variant_names_the_choices():
    with pytest.raises(ValueError, match="choose from eager, cuda-graph, compile"):
        parse_variants("eager,graphs")


def test_cuda_graph_variant_is_refused_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--cpu", "--variants", "eager,cuda-graph"])
    assert exit_info.value.code == 2
    assert "drop it from --variants" in capsys.readouterr().err


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs")
def test_every_variant_runs_and_checks_out_on_gpus(tmp_path):
    """Tiny Flux on 2 GPUs: a layer and a step each way, every row checked against the unparallelized model."""
    code = cli_main(["bench", "--level", "layer,step", "--model-size", "tiny", "--workloads", "flux-dev:512",
                     "--methods", "usp,torus", "--variants", ",".join(VARIANTS), "--machines", "1",
                     "--gpus-per-machine", "2", "--iters", "3", "--warmup", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert code == 0 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    seen = {(r["level"], r["method"]) for r in rows}
    for level, method in [("layer", "usp+cuda-graph"), ("layer", "bound+cuda-graph"), ("step", "usp+cuda-graph"),
                          ("step", "torus+compile"), ("step", "usp+compile"), ("step", "bound+compile")]:
        assert (level, method) in seen, (level, method, sorted(seen))

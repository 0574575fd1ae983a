"""`streamfusion verify` end to end, as a user runs it (spawns its own gloo job)."""
from __future__ import annotations

import pytest

from streamfusion_diffusers.cli import main

SMALL = ["--seq-len", "61", "--joint", "5", "--heads", "4", "--head-dim", "16", "--iters", "1"]


def test_verify_passes_and_prints_every_method(capsys):
    assert main(["verify", "--machines", "2", "--gpus-per-machine", "2", "--cpu", *SMALL]) == 0
    out = capsys.readouterr().out
    for method in ("ulysses", "ring", "usp", "tas", "torus"):
        line = next(line for line in out.splitlines() if line.startswith(method))
        assert line.endswith("ok"), line
    assert "4 ranks" in out


def test_verify_rejects_a_bad_layout_before_starting(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--machines", "1", "--gpus-per-machine", "4", "--methods", "ulysses", "--heads", "6"])
    assert exit_info.value.code == 2
    assert "ulysses in [1, 2]" in capsys.readouterr().err

"""`streamfusion verify --self-test` (4 gloo processes as 2 x 2, small shapes): every deliberate fault that
applies to a layout makes the exactness check fail, and a fault the check misses makes verify exit non-zero."""
from __future__ import annotations

import argparse

from streamfusion_diffusers.attention.faults import FAULTS, Exact
from streamfusion_diffusers.commands import verify
from streamfusion_diffusers.cli import main

SHAPE = ["--cpu", "--machines", "2", "--gpus-per-machine", "2", "--ulysses", "2", "--seq-len", "61",
         "--joint", "5", "--heads", "4", "--head-dim", "16", "--no-timing"]


def test_self_test_catches_every_fault_in_bfloat16(capsys):
    assert main(["verify", *SHAPE, "--dtype", "bfloat16", "--self-test"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("self-test:")]
    assert lines and not any("NOT CAUGHT" in line for line in lines), lines
    for fault in FAULTS:  # ring U1R4 has a ring and text tokens: every fault applies to it
        assert any(line.startswith("self-test: ring ") and f": {fault.name}: caught" in line for line in lines), \
            (fault.name, lines)
    assert any(line.startswith("self-test: ulysses ") for line in lines)


def test_a_fault_the_check_misses_fails_verify(capsys):
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    args = parser.parse_args([*SHAPE, "--methods", "ring", "--self-test"])
    assert verify.main(args, faults=(Exact(),)) == 1  # no fault at all: the self-test cannot catch it
    assert "self-test: ring ring 2x2 U1R4: exact: NOT CAUGHT" in capsys.readouterr().out

"""The Cache-DiT baseline of `bench --level e2e` without GPUs or cache-dit: the rows planned on 2 and 4 GPUs, the
options each row hands cache-dit (accepted by cache-dit's own ParallelismConfig where it is installed), and the
skips said on the CPU. The rows themselves run on GPUs only (tests/test_bench_e2e_gpu.py's job shape)."""
from __future__ import annotations

import argparse

import pytest
import torch

from streamfusion_diffusers.bench import cachedit, command
from streamfusion_diffusers.bench.e2e_command import _setup, e2e_cases
from streamfusion_diffusers.cli import main

SYSTEMS = list(cachedit.SYSTEMS)


def _planned(spec: str, world: int, layouts: str = "best") -> tuple[list[str], list[str]]:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    setup = _setup(spec, parser.parse_args(["--level", "e2e"]), "real", torch.bfloat16, world)
    notes: list[str] = []
    return [c.label for c in e2e_cases(SYSTEMS, setup, world, True, layouts, notes)], notes


def test_rows_on_two_and_four_gpus(monkeypatch):
    # the rows are planned from our rules (cachedit.why_not) whether or not cache-dit is importable here: where it
    # is not, planning would skip them all for that reason, so this test says it is (CI runs without cache-dit)
    monkeypatch.setattr(cachedit, "missing", lambda: None)
    labels, notes = _planned("flux-dev:1024", 2)
    assert labels == ["cache-dit U2R1", "cache-dit U1R2", "cache-dit-fp8 U2R1", "cache-dit-async U2R1"]
    assert "cache-dit-fp8 U1R2 skipped: cache-dit-fp8 is a Ulysses mode: its rows run Ulysses alone" in notes
    labels, _ = _planned("flux-dev:1024", 4)  # USP from 4 ranks on
    assert labels[:3] == ["cache-dit U4R1", "cache-dit U2R2", "cache-dit U1R4"]
    labels, notes = _planned("cogvideox-5b:49", 2, "U2R1,cache-dit-fp8:U2R1")
    assert labels == ["cache-dit U2R1", "cache-dit-fp8 U2R1"]  # no async Ulysses for CogVideoX, not asked here
    labels, notes = _planned("cogvideox-5b:49", 2)
    assert "cache-dit-async U2R1 skipped: cache-dit 1.5.3 has no asynchronous Ulysses for cogvideox" in notes


@pytest.mark.parametrize(("system", "ulysses", "ring", "expected"), [
    ("cache-dit", 2, 2, "ulysses_size=2, ring_size=2"),
    ("cache-dit", 1, 2, "ring_size=2"),
    ("cache-dit-fp8", 2, 1, "ulysses_size=2, ulysses_float8=True (lossy)"),
    ("cache-dit-async", 4, 1, "ulysses_size=4, ulysses_async=True"),
])
def test_each_row_hands_cache_dit_its_options(system, ulysses, ring, expected):
    assert cachedit.layout(system, ulysses, ring, vae=False) == expected
    options = cachedit.parallelism_options(system, ulysses, ring)
    if cachedit.missing() is None:
        import cache_dit

        config = cache_dit.ParallelismConfig(**options)  # cache-dit's own checks of the degrees and modes
        assert (config.ulysses_size, config.ring_size) == (options["ulysses_size"], options["ring_size"])
        assert (config.ulysses_float8, config.ulysses_async) == (options["ulysses_float8"], options["ulysses_async"])


@pytest.mark.slow  # a long end-to-end run: its parts have faster tests; pytest -m slow runs it
def test_cache_dit_on_the_cpu_is_skipped_with_the_reason(tmp_path, capsys):
    rc = main(["bench", "--cpu", "--level", "e2e", "--workloads", "flux-dev:64", "--methods", ",".join(SYSTEMS),
               "--steps", "1", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 0
    assert "cache-dit skipped: it needs GPUs (its context parallelism places rank r on accelerator r" in err

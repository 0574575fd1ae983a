"""`streamfusion verify` end to end, as a user runs it (spawns its own gloo job)."""
from __future__ import annotations

import os
import warnings

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


def test_commands_quiet_the_import_notices_of_optional_libraries_in_every_rank(monkeypatch):
    """torchao's "Failed to load" lines and torch's pytree Enum notice are dropped by a command (and its spawned
    ranks, through STREAMFUSION_QUIET) unless -v; -v keeps them."""
    import logging

    from streamfusion_diffusers.core import logs

    monkeypatch.setattr(warnings, "filters", warnings.filters[:])
    for name in ("STREAMFUSION_QUIET", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)
    for name in logs.NOISY_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    logs.quiet_third_party(verbose=True)
    assert "STREAMFUSION_QUIET" not in os.environ
    assert all(logging.getLogger(n).level == logging.NOTSET for n in logs.NOISY_LOGGERS)
    logs.quiet_third_party(verbose=False)
    assert os.environ["STREAMFUSION_QUIET"] == "1"
    assert all(logging.getLogger(n).level == logging.ERROR for n in ("torchao", "torch.utils._pytree"))


def test_verbose_goes_before_or_after_the_subcommand_and_version_prints_the_package_version(capsys):
    """`streamfusion serve ... -v` as every failure's hint words it, `streamfusion -v serve` as before."""
    import importlib.metadata

    from streamfusion_diffusers.cli import make_parser

    parser = make_parser()
    for argv, verbose in ((["serve", "-v"], True), (["-v", "serve"], True), (["generate", "--verbose"], True),
                          (["serve"], False)):
        assert parser.parse_args(argv).verbose is verbose, argv
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"streamfusion {importlib.metadata.version('streamfusion-diffusers')}"

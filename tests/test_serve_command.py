"""`streamfusion serve`'s refusals: each one line naming the fix, before any process starts (no server here)."""
from __future__ import annotations

import socket

import pytest

from streamfusion_diffusers.cli import main
from streamfusion_diffusers.choice.replicas import replica_shape


def _refused(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_replicas_split_whole_machines_first_then_each_machine():
    assert replica_shape(2, 2, 2) == (1, 2)
    assert replica_shape(1, 8, 4) == (1, 2)
    assert replica_shape(2, 4, 4) == (1, 2)
    assert replica_shape(2, 2, 1) == (2, 2)
    with pytest.raises(ValueError, match="--replicas 3"):
        replica_shape(2, 2, 3)


@pytest.mark.parametrize("argv, words", [
    (("--replicas", "3"), "--replicas 3 does not split"),
    (("--replicas", "0"), "--replicas 0: must be at least 1"),
    (("--max-queue", "0"), "--max-queue 0: must be at least 1"),
    (("--port", "70000"), "--port 70000: must be 0 .. 65535"),
    (("--request-timeout", "0"), "--request-timeout 0: must be at least"),
    (("--model", "flux-dev"), "real-size model and no GPU"),
    (("--height", "62"), "--height 62: must be a multiple of 4"),
    (("--keep-videos", "0"), "--keep-videos 0: must be above 0"),
    (("--video-ttl", "-1"), "--video-ttl -1.0: must be above 0"),
    (("--allow-origin", "pages.example"), "--allow-origin pages.example: must be scheme://host[:port]"),
    (("--emulate-link", "infiniband"), "--emulate-link: link 'infiniband' is neither a preset (dgx, p4de, p5)"),
    (("--emulate-link", "p4de", "--replicas", "2"), "each group of --replicas lies inside one machine"),
])
def test_bad_options_are_one_line(capsys, argv, words):
    assert words in _refused(capsys, *argv)


def test_a_busy_port_is_one_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _refused(capsys, "--port", str(port))


def test_under_torchrun_a_split_of_the_nodes_into_unequal_groups_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "does not split 2 machine(s) x 2 process(es)" in _refused(capsys, "--replicas", "3")


def test_groups_of_a_job_across_machines_are_whole_machines_or_a_share_of_each():
    from streamfusion_diffusers.serve.command import group_slots

    assert group_slots(2, 2, 1) == [[0, 1, 2, 3]]  # one group spanning both nodes
    assert group_slots(2, 2, 2) == [[0, 1], [2, 3]]  # one group per node
    assert group_slots(2, 4, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_slots(4, 2, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_on_the_cpu_a_tiny_model_says_its_size_limit_and_refuses_512x512_unless_max_pixels_raises_it(caplog):
    """Open WebUI's default 512x512 would take minutes on the CPU with every request behind it: the start says the
    limit in one line, and the request is refused with a 400 naming it and --max-pixels."""
    import argparse
    import logging

    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.errors import ApiError
    from streamfusion_diffusers.serve.limits import limits
    from streamfusion_diffusers.serve.protocol import ImageRequest
    from streamfusion_diffusers.serve.validation import Checker

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-flux", "--cpu"])
    job, _ = serve_job(args)
    with caplog.at_level(logging.INFO, logger="streamfusion_diffusers.serve"):
        found = limits(args, job)
    said = [r.getMessage() for r in caplog.records if "on the CPU" in r.getMessage()]
    assert found.max_pixels == 256 * 256 and len(said) == 1 and "at most 65536 pixels (256x256)" in said[0], said
    checker = Checker(job, found)
    assert checker.image(ImageRequest(prompt="a", size="256x256")).size == "256x256"
    with pytest.raises(ApiError) as refused:
        checker.image(ImageRequest(prompt="a", size="512x512"))
    assert refused.value.status == 400 and "at most 65536 (--max-pixels)" in refused.value.message
    raised = parser.parse_args(["--model", "tiny-flux", "--cpu", "--max-pixels", str(512 * 512)])
    assert Checker(job, limits(raised, job)).image(ImageRequest(prompt="a", size="512x512")).size == "512x512"


@pytest.mark.parametrize(("model", "given", "runs"), [("tiny-flux2", "auto", "tensor"), ("tiny-wan", "auto", "gather"),
                                                   ("tiny-flux2", "gather", "gather")])
def test_a_sharded_server_admits_by_the_streamed_blocks_its_build_runs(monkeypatch, model, given, runs):
    """On GPUs a sharded group's limits count the streamed blocks' activations as its build runs them: for "auto",
    the way that moves fewer bytes at the default size (tiny Flux.2: tensor-parallel; Wan, which has no
    tensor-parallel plan: gathered)."""
    import argparse
    import dataclasses
    import types

    import torch

    from streamfusion_diffusers.models import memory
    from streamfusion_diffusers.serve.command import add_arguments, serve_job
    from streamfusion_diffusers.serve.limits import limits

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", model, "--cpu", "--shard-weights", "--streamed-blocks", given])
    job = dataclasses.replace(serve_job(args)[0], gpu=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=memory.GIB))
    asked = {}
    monkeypatch.setattr(memory, "largest_size", lambda *a, **kw: asked.update(kw) or (4096, 9))
    assert limits(args, job).max_pixels == 4096 and asked["streamed"] == runs and asked["sharded"]

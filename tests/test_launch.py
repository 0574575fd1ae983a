"""`streamfusion launch`: the torchrun command it builds and the NVSHMEM heap it sizes (no processes started)."""
from __future__ import annotations

import pytest

from streamfusion_diffusers.attention.volume import peer_bytes
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.commands.launch import heap_bytes, sequence_tokens
from streamfusion_diffusers.core.config import ParallelConfig, resolve_layout
from streamfusion_diffusers.core.sequence import split_sizes


def test_dry_run_prints_torchrun_with_the_heap(capsys, monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert main(["launch", "--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1", "--master-addr", "10.0.0.7",
                 "--model", "flux-dev", "--resolution", "2048", "--dry-run", "-m", "streamfusion_diffusers",
                 "generate", "--model", "flux-dev"]) == 0
    out = capsys.readouterr().out
    heap = heap_bytes(*sequence_tokens("flux-dev", 2048, 2048), machines=2, gpus_per_machine=4)
    assert out.startswith(f"NVSHMEM_SYMMETRIC_SIZE={heap} ")
    assert "--nnodes=2 --nproc-per-node=4 --node-rank=1 --master-addr=10.0.0.7" in out
    assert out.rstrip().endswith("--module streamfusion_diffusers generate --model flux-dev")


def test_print_env_keeps_a_heap_the_user_set(capsys, monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "8G")
    assert main(["launch", "--nproc-per-node", "8", "--model", "cogvideox-5b", "--frames", "49", "--print-env"]) == 0
    assert capsys.readouterr().out == ""


def test_heap_covers_every_method_layer():
    tokens, joint, heads, dim = sequence_tokens("cogvideox-5b", 768, 1360, 161)
    assert tokens == 41 * 48 * 85 and (joint, heads, dim) == (226, 48, 64)
    heap = heap_bytes(tokens, joint, heads, dim, machines=2, gpus_per_machine=4)
    lens = split_sizes(tokens, 8)
    for method in ("ulysses", "ring", "usp", "tas", "torus"):
        layout = resolve_layout(ParallelConfig(machines=2, gpus_per_machine=4, method=method), 8, heads)
        assert 8 * peer_bytes(layout, lens, 1, heads, dim, joint, 2) < heap


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1", "x.py"], "--node-rank 2 is not in 0 .. 1"),
    (["--nproc-per-node", "1"], "name the script"),
])
def test_bad_arguments_name_the_fix(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

"""`streamfusion bench --level block,step` end to end on 4 CPU processes (2 x 2): a tiny Flux and a tiny
CogVideoX, every method of ours beside the no-comm bound, each row checked against the unparallelized model."""
from __future__ import annotations

import json

import pytest
import torch

from streamfusion_diffusers.choice.workloads import parse_workload, transformer_config
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.core.exactness import MODEL_THRESHOLD

METHODS = {"ulysses", "ring", "usp", "tas", "torus"}


@pytest.mark.slow  # a long end-to-end run: its parts have faster tests; pytest -m slow runs it
def test_block_and_step_levels_time_and_check_every_method(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--cpu", "--level", "block,step", "--workloads", "flux-dev:128,cogvideox-5b:5:64:64",
               "--model-size", "tiny", "--machines", "2", "--gpus-per-machine", "2", "--emulate-link", "p4de",
               "--methods", ",".join(sorted(METHODS)) + ",diffusers-cp", "--layouts", "U4R1,U1R4,U2R2,U2R2T2",
               "--iters", "2", "--warmup", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert result["setup"]["levels"] == ["block", "step"] and result["setup"]["model_size"] == "tiny"
    assert all(r["ok"] and r["ms"] > 0 for r in rows), rows
    for workload in ("flux-dev 128x128", "cogvideox-5b 5f 64x64"):
        for level in ("block", "step"):
            mine = [r for r in rows if r["workload"] == workload and r["level"] == level]
            assert {r["method"] for r in mine} == METHODS | {"bound"}, mine
            assert all(r["rel_err"] <= MODEL_THRESHOLD[torch.float32] for r in mine if r["method"] != "bound"), mine
            assert [r["layout"] for r in mine if r["method"] == "bound"] == ["no-comm bound"]
            bound = next(r["ms"] for r in mine if r["method"] == "bound")
            for r in mine[1:]:  # ours: each has its layers' link bound, and "x bound" is against the larger
                assert r["link_bound_ms"] > 0 and r["vs_bound"] == r["ms"] / max(bound, r["link_bound_ms"]), r
    assert "diffusers-cp skipped" in captured.err and "needs GPUs" in captured.err
    assert (out / "table.md").read_text().count("| flux-dev 128x128 | block |") == len(rows) // 4


def test_step_level_of_the_newer_models(tmp_path, capsys):
    """Tiny Wan 2.2 and Qwen-Image steps through their plans on 2 processes, exact; no bound (it runs through the
    Flux and CogVideoX processors), and no block level for them."""
    out = tmp_path / "newer"
    rc = main(["bench", "--cpu", "--level", "step", "--workloads", "wan2.2-ti2v-5b:9:64:96,qwen-image:64",
               "--model-size", "tiny", "--machines", "1", "--gpus-per-machine", "2", "--methods", "ulysses,ring",
               "--iters", "2", "--warmup", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["workload"], r["method"]) for r in rows} == {
        (w, m) for w in ("wan2.2-ti2v-5b 9f 96x64", "qwen-image 64x64") for m in ("ulysses", "ring")}, rows
    assert all(r["ok"] and r["rel_err"] <= MODEL_THRESHOLD[torch.float32] for r in rows), rows
    assert "bound skipped for qwen-image 64x64" in captured.err
    with pytest.raises(SystemExit):
        main(["bench", "--cpu", "--level", "block", "--workloads", "qwen-image:64", "--model-size", "tiny"])
    assert "run the newer models at --level step" in capsys.readouterr().err


def test_bad_level_fails_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--cpu", "--level", "block,steps", "--workloads", "flux-dev:256"])
    assert exit_info.value.code == 2
    assert "unknown level(s) ['steps'] in --level; choose from layer, block, step" in capsys.readouterr().err


def test_model_shapes_of_workloads():
    cog = parse_workload("cogvideox-5b:9:128:128")
    assert cog.grid == (3, 16, 16) and cog.tokens == 3 * 8 * 8
    assert transformer_config(cog, "real")["num_attention_heads"] == 48
    assert transformer_config(cog, "tiny")["num_attention_heads"] == 8
    wan = parse_workload("wan2.2-t2v-a14b:17:480:832")  # Wan 2.1's VAE: 8x, 2 x 2 patches; text by cross-attention
    assert wan.grid == (5, 30, 52) and wan.tokens == 5 * 30 * 52 and wan.text_tokens == 0 and wan.heads == 40
    qwen = parse_workload("qwen-image")  # generate's default size, 1328 x 1328
    assert qwen.tokens == 83 * 83 and transformer_config(qwen, "tiny")["num_attention_heads"] == 8
    custom = transformer_config(parse_workload("custom:250:6:12:64"), "real")
    assert custom["num_attention_heads"] == 12 and sum(custom["axes_dims_rope"]) == 64

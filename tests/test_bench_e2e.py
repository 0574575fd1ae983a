"""`streamfusion bench --level e2e` on 2 CPU processes: whole tiny Flux (true CFG) and CogVideoX generations, each
phase timed for ours and for one process alone, ours' outputs checked against the one-process pipeline's; the
GPU-only baselines skipped with their reason."""
from __future__ import annotations

import json

import pytest
import torch

from streamfusion_diffusers.bench.e2e_command import _baseline_layouts
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.runtime.phases import PHASES
from streamfusion_diffusers.core.exactness import LOWP_THRESHOLD, MODEL_THRESHOLD

OURS = {"ours", "ours-no-vae-split", "ours-cfg"}


def test_e2e_times_every_phase_and_matches_one_process(tmp_path, capsys):
    out = tmp_path / "e2e"
    rc = main(["bench", "--cpu", "--level", "e2e", "--workloads", "flux-dev:64,cogvideox-5b:9:64:64",
               "--model-size", "tiny", "--machines", "1", "--gpus-per-machine", "2", "--steps", "2",
               "--true-cfg-scale", "2.0", "--iters", "2", "--warmup", "0", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    for workload in ("flux-dev 64x64", "cogvideox-5b 9f 64x64"):
        mine = {r["system"]: r for r in rows if r["workload"] == workload}
        assert set(mine) == OURS | {"one-gpu"}, mine
        for r in mine.values():
            assert all(0 < r["phases"][p]["min"] <= r["phases"][p]["median"] <= r["phases"][p]["max"]
                       for p in PHASES), r
            assert r["phases"]["total"]["median"] >= r["phases"]["denoising"]["median"], r
        assert mine["one-gpu"]["rel_err"] is None
        for system in OURS:  # exact against one process (float32), the VAE split against diffusers' tiled decode
            assert mine[system]["ok"] and mine[system]["rel_err"] <= MODEL_THRESHOLD[torch.float32], mine[system]
        assert mine["ours"]["reference"].endswith("tiled decode")
        assert mine["ours-no-vae-split"]["reference"] == "one-gpu, untiled decode"
        assert mine["ours-cfg"]["layout"].startswith("cfg 2 x ")
    assert "diffusers-cp skipped" in captured.err and "xfuser skipped" in captured.err
    table = (out / "table.md").read_text()
    assert "### flux-dev 64x64" in table and "| ours-cfg | cfg 2 x " in table and "x one-gpu" in table
    assert any(line.startswith("cogvideox-5b 9f 64x64: ") and "vs one-gpu" in line for line in result["summary"])


@pytest.mark.slow  # a long end-to-end run: its parts have faster tests; pytest -m slow runs it
def test_e2e_rows_of_the_newer_pipelines(tmp_path, capsys):
    """Tiny Wan 2.2 (TI2V-style: its CFG as two calls per step, paired over the branches), Qwen-Image (true
    CFG) and Flux.2 (its prompt encoded first) on 2 processes: ours and ours-cfg exact against one process, with
    how the VAE decoded."""
    out = tmp_path / "new"
    rc = main(["bench", "--cpu", "--level", "e2e", "--workloads", "wan2.2-ti2v-5b:9:64:64,qwen-image:64,flux2-dev:64",
               "--model-size", "tiny", "--machines", "1", "--gpus-per-machine", "2", "--methods", "ours,ours-cfg",
               "--steps", "2", "--true-cfg-scale", "2.0", "--iters", "1", "--warmup", "0", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["workload"], r["system"]) for r in rows} == {
        (w, s) for w in ("wan2.2-ti2v-5b 9f 64x64", "qwen-image 64x64") for s in ("ours", "ours-cfg")} | {
        ("flux2-dev 64x64", "ours")}, rows
    for r in rows:
        assert r["ok"] and r["rel_err"] <= MODEL_THRESHOLD[torch.float32], r
        assert r["vae_decode"] in ("patch-parallel", "tiles", "whole"), r
        assert r["reference"] == f"one-gpu, {'tiled' if r['vae_decode'] == 'tiles' else 'untiled'} decode", r
    assert all(r["layout"].startswith("cfg 2 x ") for r in rows if r["system"] == "ours-cfg"), rows


@pytest.mark.slow  # a long end-to-end run: its parts have faster tests; pytest -m slow runs it
def test_e2e_on_two_emulated_machines_with_fp8_transfers(tmp_path, capsys):
    """2 x 1 over an emulated p4de link: ours with fp8 inter-machine transfers (checked loosely) and ours-cfg, whose
    guidance branches sit one per machine; the baselines, whose transfers cannot be slowed, are skipped."""
    out = tmp_path / "emu"
    rc = main(["bench", "--cpu", "--level", "e2e", "--workloads", "cogvideox-5b:9:64:64", "--model-size", "tiny",
               "--machines", "2", "--gpus-per-machine", "1", "--emulate-link", "p4de", "--comm-dtype", "fp8",
               "--methods", "ours,ours-cfg,xfuser", "--steps", "2", "--iters", "1", "--warmup", "0",
               "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"ours", "ours-cfg"} and all(r["ok"] for r in rows.values()), rows
    assert 0 < rows["ours"]["rel_err"] <= LOWP_THRESHOLD, rows
    assert rows["ours-cfg"]["rel_err"] <= MODEL_THRESHOLD[torch.float32], rows  # no link crossed
    assert "--emulate-link slows our transfers only" in captured.err
    assert "emulated as p4de, fp8 inter-machine transfers" in (out / "table.md").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (("--level", "e2e,step", "--workloads", "flux-dev:64"), "run it on its own"),
    (("--level", "e2e", "--methods", "torus", "--workloads", "flux-dev:64"), "unknown system"),
    (("--level", "e2e", "--workloads", "custom:64:8:8:16"), "whole pipelines"),
])
def test_e2e_refuses_bad_requests_before_any_process(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--cpu", *argv])
    assert message in capsys.readouterr().err


def test_baseline_layouts():
    assert _baseline_layouts("U2R1,xfuser:cfg2U1R1") == {(None, 1, 2, 1), ("xfuser", 2, 1, 1)}
    assert _baseline_layouts("best") is None
    with pytest.raises(ValueError, match="like U2R1, cfg2U1R1 or xfuser:U2R1"):
        _baseline_layouts("2x1")


def test_gpu_cases_are_planned_per_baseline():
    """On 2 GPUs (planned here, not run): diffusers' CP at each Ulysses x Ring layout for Flux, xfuser with and
    without its CFG split for CogVideoX when installed, ours-cfg only where guidance has two branches."""
    import argparse

    import torch

    from streamfusion_diffusers.bench import command
    from streamfusion_diffusers.bench.e2e_command import _setup, e2e_cases

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--level", "e2e", "--steps", "5", "--iters", "2", "--warmup", "1"])
    flux = _setup("flux-dev:2048", args, "real", torch.bfloat16, 2)
    cog = _setup("cogvideox-5b:49:480:720", args, "real", torch.bfloat16, 2)
    assert (flux.height, flux.width, flux.full) == (2048, 2048, True)
    assert (cog.frames, cog.height, cog.width, cog.guidance_scale) == (49, 480, 720, 6.0)
    notes: list[str] = []
    systems = ["one-gpu", "ours", "ours-cfg", "diffusers-cp", "xfuser"]
    labels = [c.label for c in e2e_cases(systems, flux, 2, True, "U2R1,U1R2,xfuser:cfg2U1R1", notes)]
    assert labels == ["one-gpu", "ours", "diffusers-cp U2R1", "diffusers-cp U1R2"]
    labels = [c.label for c in e2e_cases(systems, cog, 2, True, "U2R1,U1R2,xfuser:cfg2U1R1", notes)]
    xfuser = [] if "xfuser skipped: not installed" in " ".join(notes) else ["xfuser cfg2 U1R1", "xfuser U2R1",
                                                                            "xfuser U1R2"]
    assert labels == ["one-gpu", "ours", "ours-cfg", *xfuser]
    assert any("ours-cfg skipped for flux-dev 2048x2048" in n for n in notes)
    assert any("no context-parallel plan for CogVideoX" in n for n in notes)
    wan = _setup("wan2.2-t2v-a14b:17:480:832", args, "real", torch.bfloat16, 2)  # CFG by guidance_scale
    labels = [c.label for c in e2e_cases(systems, wan, 2, True, "U2R1", notes)]
    assert (wan.model, wan.guidance_scale) == ("wan2.2-t2v-a14b", 4.0) and labels == [
        "one-gpu", "ours", "ours-cfg", "diffusers-cp U2R1"]
    qwen = _setup("qwen-image:1024", args, "real", torch.bfloat16, 2)
    assert [c.label for c in e2e_cases(systems, qwen, 2, True, "U2R1", notes)] == ["one-gpu", "ours"]
    assert any("diffusers-cp skipped for qwen-image 1024x1024: its text is as long" in n for n in notes)
    one = [c.label for c in e2e_cases(systems + ["cache-dit"], wan, 1, True, "best", notes)]
    assert one == ["one-gpu", "ours"] and any("diffusers-cp skipped: its context parallelism needs 2+" in n
                                               for n in notes)


@pytest.mark.parametrize(("name", "sizes"), [
    ("flux-dev", {"text_encoder": 123.06e6, "text_encoder_2": 4762.3e6, "vae": 83.82e6, "transformer": 11901.4e6}),
    ("cogvideox-5b", {"text_encoder": 4762.3e6, "vae": 215.58e6, "transformer": 5570.3e6}),
])
def test_full_pipelines_have_the_real_models_sizes(name, sizes):
    """CLIP-L, T5-XXL's encoder and the real VAEs (parameter counts of the released checkpoints), built on the meta
    device: shapes only, no memory."""
    import torch

    from streamfusion_diffusers.models.full import build_full_pipeline

    pipe = build_full_pipeline(name, device="meta")
    counts = {k: sum(p.numel() for p in v.parameters()) for k, v in pipe.components.items()
              if isinstance(v, torch.nn.Module)}
    assert counts.keys() == sizes.keys()
    assert all(abs(counts[k] - sizes[k]) / sizes[k] < 1e-4 for k in sizes), counts

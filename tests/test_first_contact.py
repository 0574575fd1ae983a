"""What a new user meets first: bad options end in one line before any process starts, a real-size model is
refused without GPUs, a killed rank ends `streamfusion generate`, the README's Python snippet runs as written,
the package root exports what the README uses, `tune`'s recipes are what method "auto" reads by default, a
video model writes an mp4, and every command runs without the serve extra."""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from streamfusion_diffusers.choice.choose import Cluster, choose
from streamfusion_diffusers.choice.store import write_recipe
from streamfusion_diffusers.choice.workloads import flux
from streamfusion_diffusers.cli import main
from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.core.extras import install_hint
from streamfusion_diffusers.runtime import output

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("argv, message", [
    (["generate", "--height", "0"], "--height 0: must be at least 1"),
    (["generate", "--steps", "-1"], "--steps -1: must be at least 1"),
    (["generate", "--machines", "0"], "--machines 0: must be at least 1"),
    (["generate", "--weights", "/missing/path"], "--weights /missing/path: no such folder"),
    (["generate", "--height", "66"], "--height 66: must be a multiple of 4"),
    (["generate", "--frames", "9"], "--frames is for video models"),
    (["generate", "--recipe", "nowhere"], "--recipe nowhere: no recipe"),
    (["generate", "--emulate-link", "25"], "--emulate-link: link '25' is neither a preset"),
    (["generate", "--emulate-link", "p4de", "--machines", "1"], "the job runs on one machine: add --machines N"),
    (["verify", "--iters", "0"], "--iters 0: must be at least 1"),
    (["launch", "--master-port", "70000", "x.py"], "--master-port 70000: must be 1 .. 65535"),
    (["plan", "--machines", "0"], "--machines 0: must be at least 1"),
])
def test_a_bad_option_is_one_line_naming_it(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err and out == "", err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where no GPU is visible")
def test_a_real_size_model_without_gpus_is_refused_with_what_works(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "flux-dev"])
    err = capsys.readouterr().err
    assert "no GPU is visible" in err and "--model tiny-flux" in err and "--cpu" in err


def test_the_root_exports_what_the_readme_uses_and_imports_without_diffusers():
    code = ("import sys, streamfusion_diffusers as sf; assert 'diffusers' not in sys.modules; "
            "from streamfusion_diffusers import parallelize, unparallelize, shutdown, init_parallel, ParallelConfig, "
            "sp_attention; assert callable(parallelize) and parallelize.__name__ == 'parallelize'; "
            "import streamfusion_diffusers.diffusers.parallel_pipeline; "
            "from streamfusion_diffusers import parallelize as again; assert again is parallelize")
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, timeout=120)


def test_the_readme_python_snippet_runs_as_written_on_4_ranks(tmp_path):
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"## Using it from diffusers\n.*?```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "snippet.py"
    script.write_text(snippet + "open(f'rank{ctx.global_rank}.txt', 'w').write(str(image.size))\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                          "--master-port", str(_free_port()), str(script)], env=ENV, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(4)] == ["(64, 64)"] * 4


def test_a_killed_rank_ends_generate_within_seconds(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "streamfusion_diffusers", "generate", "--steps", "500",
                            "--output", str(tmp_path)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    ranks = _wait_for_ranks(job.pid, 4)
    time.sleep(8)  # past the ranks' start-up (imports, the gloo mesh): into the build or the denoising loop
    os.kill(ranks[-1], signal.SIGKILL)
    killed = time.monotonic()
    out, err = job.communicate(timeout=90)
    assert job.returncode != 0 and time.monotonic() - killed < 90
    said = [line for line in re.sub(r"tiny-flux auto:[^\n]*?it/s\]", "", err).splitlines() if line]  # (bars: \r)
    assert len(said) == 1 and "killed by SIGKILL" in said[0] and "Traceback" not in err, err
    assert out.startswith("streamfusion generate: starting tiny-flux (random weights) on 4 CPU processes as 2 "
                          "machines x 2, method auto;"), out  # said before any process starts
    time.sleep(1)
    assert not [pid for pid in ranks if _alive(pid)], "ranks left behind"


def test_tune_writes_where_auto_reads_first(tmp_path, monkeypatch):
    shape, cluster = flux(1024), Cluster(1, 4)
    monkeypatch.setenv("STREAMFUSION_RECIPES", str(tmp_path / "tuned"))
    assert main(["tune", "--from-cost-model", "--workloads", "flux-dev:1024", "--machines", "1",
                 "--gpus-per-machine", "4"]) == 0  # the default --out: the user's folder
    assert str(tmp_path / "tuned" / "flux-dev.yaml") in choose(shape, cluster).why  # no recipe named


def test_the_users_entries_come_before_the_packaged_ones(tmp_path, monkeypatch):
    shape, cluster = flux(1024), Cluster(1, 4)
    packaged = choose(shape, cluster, recipe="flux-dev")
    assert "(packaged)" in packaged.why and packaged.layout.method != "tas"
    monkeypatch.setenv("STREAMFUSION_RECIPES", str(tmp_path))
    # measured at another size than the packaged entry for 1024: the user's entry still comes first
    mine = {"machines": 1, "gpus_per_machine": 4, "method": "tas", "resolution": 1536, "source": "measured"}
    write_recipe(tmp_path / "mine.yaml", "flux-dev", [mine])
    choice = choose(shape, cluster)
    assert choice.layout.method == "tas" and str(tmp_path / "mine.yaml") in choice.why, choice.why


@pytest.mark.parametrize("encoder", [True, False])
def test_a_video_model_writes_an_mp4_else_png_frames_said_once(tmp_path, monkeypatch, caplog, encoder):
    """The diffusers extra brings imageio-ffmpeg (a wheel with ffmpeg in it): video.mp4 by default; without it,
    PNG frames and one warning naming the extra."""
    import imageio.v2 as imageio
    from PIL import Image

    if not encoder:
        monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as if not installed
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    job = generate.make_job(parser.parse_args(["--model", "tiny-wan", "--height", "64", "--width", "96",
                                               "--output", str(tmp_path)]))
    frames = [Image.new("RGB", (96, 64), (8 * i, 100, 200)) for i in range(9)]
    written = output.write(frames, job.spec.video, job.output)
    if encoder:
        assert written == [str(tmp_path / "video.mp4")] and not caplog.records
        video = imageio.mimread(written[0])
        assert len(video) == 9 and video[0].shape == (64, 96, 3)
    else:
        assert written == [str(tmp_path / "frames" / f"{i:03d}.png") for i in range(9)]
        assert [r.getMessage() for r in caplog.records] == [
            f"no video encoder installed: writing the frames as PNGs (for video.mp4: {install_hint('diffusers')})"]


def _free_port() -> int:
    from streamfusion_diffusers.runtime.pool import free_port

    return free_port()


def _children(pid: int) -> list[int]:
    """The rank processes of `pid`'s pool: its children spawned (GPU), or forked by its fork server (CPU)."""
    processes = {}  # pid -> (parent pid, command line)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            processes[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    servers = {p for p, (parent, cmd) in processes.items() if parent == pid and b"forkserver" in cmd}
    return sorted(p for p, (parent, cmd) in processes.items()
                  if (parent == pid and b"spawn_main" in cmd) or parent in servers)


def _wait_for_ranks(pid: int, world: int, within_s: float = 120.0) -> list[int]:
    ends = time.monotonic() + within_s
    while len(ranks := _children(pid)) < world:
        assert time.monotonic() < ends, f"only {len(ranks)} of {world} ranks started"
        time.sleep(0.2)
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


WITHOUT_SERVE = """
import sys
for name in ("fastapi", "uvicorn", "starlette", "pydantic", "multipart", "prometheus_client"):
    sys.modules[name] = None  # as if never installed: an import fails, find_spec says None
from streamfusion_diffusers.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("argv, said", [(["--version"], "streamfusion "),
                                        (["serve", "--model", "tiny-flux"], 'pip install -e ".[serve]"')],
                         ids=["a-command", "serve"])
def test_without_the_serve_extra_every_command_runs_and_serve_names_the_extra(argv, said):
    """Installed with `[diffusers]` alone, the parser of every command still builds (generate's included), and
    serve says once which extra it needs."""
    done = subprocess.run([sys.executable, "-c", WITHOUT_SERVE, *argv], capture_output=True, text=True, timeout=120)
    assert said in done.stdout + done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr

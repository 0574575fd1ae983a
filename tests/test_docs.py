"""The commands of README.md and docs/USER_GUIDE.md: every one is either run here as written (CPU) or left out
with its reason, so a command added to the docs is run or explained."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "USER_GUIDE.md")

LEFT_OUT = {  # how a command starts -> why it is not run here
    "python3 -m venv": "makes the environment these tests run in",
    ". .venv/bin/activate": "enters the environment these tests run in",
    "pip install": "installs the environment these tests run in",
    "python -m pytest": "the test suite itself",
    "torchrun": "GPUs, one NCCL process each",
    "accelerate launch": "GPUs, one NCCL process each",
    "streamfusion launch --n": "GPUs: torchrun of a real-size model or a device script",
    "python3 -m streamfusion_diffusers launch": "GPUs: torchrun of a device script",
    "python benchmarks/": "a device script's summary of GPU results",
    "python3 benchmarks/": "GPUs (device script)",
    "bash benchmarks/": "GPUs (device script)",
    "streamfusion generate --model flux-dev": "real size: GPUs (without them it is refused; test_first_contact.py)",
    "streamfusion verify": "8 processes for 80 s on 2 cores; tests/test_cli.py runs verify end to end on 4",
    "streamfusion generate --model tiny-cogvideox": "tests/test_pipeline.py runs this job (tiny CogVideoX, usp)",
    "streamfusion generate --model tiny-wan": "tests/test_generate_models_p4.py runs this job (cfg 2)",
    "streamfusion generate --model tiny-qwen-image": "tests/test_generate_models_p4.py runs this job (true CFG)",
    "streamfusion bench --cpu --machines 2 --gpus-per-machine 2 --workloads custom:250:6:8:16":
        "tests/test_bench.py runs this layer-level job on 2 x 2",
    "streamfusion bench --cpu --level block,step": "tests/test_bench_levels.py runs this on 2 x 2, at half the tokens",
    "streamfusion bench --cpu --level e2e": "tests/test_bench_e2e.py runs these workloads",
    "streamfusion tune --from-cost-model": "rewrites the packaged recipes",
    "streamfusion tune --merge-from": "merges a device run's output",
    "streamfusion serve": "a server that runs until stopped: tests/test_serve*.py start it and talk to it",
    "curl": "talks to a running server: tests/test_serve.py sends these requests",
}


def commands(path: Path) -> list[str]:
    """Every command of the file's bash blocks: continued lines joined, comments dropped, `&&` chains split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*", "", line).strip()
            if line and not line.startswith("#"):
                found += [" ".join(part.split()) for part in line.split(" && ")]
    return found


def left_out(command: str) -> str | None:
    return next((why for start, why in LEFT_OUT.items() if command.startswith(start)), None)


RUN = sorted({c for doc in DOCS for c in commands(doc) if left_out(c) is None})


def test_every_command_is_run_or_left_out_with_a_reason():
    for command in RUN:
        assert re.match(r"(eval \"\$\()?streamfusion ", command), f"neither run here nor left out: {command}"


@pytest.mark.parametrize("command", RUN)
def test_the_command_runs_as_written(command, tmp_path):
    python = f"{sys.executable} -m streamfusion_diffusers "
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAMFUSION_RECIPES": str(tmp_path / "recipes")}
    run = subprocess.run(command.replace("streamfusion ", python), shell=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

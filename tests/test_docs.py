"""The commands of README.md and docs/USER_GUIDE.md: every one is either run here as written (CPU) or left out
with its reason, so a command added to the docs is run or explained; README's test command is the one CI runs;
both docs state what is true now (no session numbers, issue numbers or dates: the history is the records'); the
guide's complete script (`my_flux.py`) runs as written under torchrun on 2 CPU processes, gives the
unparallelized image and says transformers' notices once."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streamfusion_diffusers.runtime.pool import free_port
from streamfusion_diffusers.core.exactness import relative_error

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "USER_GUIDE.md"
DOCS = (ROOT / "README.md", GUIDE)
RANKS = 2
# what .ci/run installs and runs in a fresh environment, as README's quick start says it
TEST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" '
                '&& python -m pytest -q')

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
    "streamfusion generate --cache": "tests/test_stack_p4.py runs this stack, with a LoRA it makes",
    "streamfusion bench --cpu --machines 2 --gpus-per-machine 2 --workloads custom:250:6:8:16":
        "tests/test_bench.py runs this layer-level job on 2 x 2",
    "streamfusion bench --cpu --level block,step": "tests/test_bench_levels.py runs this on 2 x 2, at half the tokens",
    "streamfusion bench --cpu --level e2e": "tests/test_bench_e2e.py runs these workloads",
    "streamfusion tune --from-cost-model": "rewrites the packaged recipes",
    "streamfusion tune --merge-from": "merges a device run's output",
    "streamfusion serve": "a server that runs until stopped: tests/test_serve*.py start it and talk to it",
    "curl": "talks to a running server: tests/test_serve.py sends these requests",
    "until curl": "waits for a running server: tests/serve_cases.py waits for its ready line",
    "kill %1": "stops the server the block started: tests/test_serve_faults.py sends SIGTERM",
    "docker build": "builds the deploy image: tests/test_deploy.py checks its Dockerfile",
    "kubectl": "needs a Kubernetes cluster: tests/test_deploy.py checks the example's objects",
    "for K in 0 1; do streamfusion launch": "two launchers serving until stopped: tests/test_serve_nodes.py runs them",
    "export STREAMFUSION_JOIN_KEY": "the join secret the launchers below share: tests/test_serve_nodes.py sets one",
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


def test_the_readme_test_command_is_what_ci_runs():
    readme = [" ".join(line.split()) for line in (ROOT / "README.md").read_text().splitlines()]
    assert TEST_COMMAND in readme, f"README.md's test command should read: {TEST_COMMAND}"
    ci = {" ".join(line.replace(" -q", "").split()) for line in (ROOT / ".ci" / "run").read_text().splitlines()}
    steps = [step.replace(" -q", "") for step in TEST_COMMAND.split(" && ")[2:]]
    assert all(step in ci for step in steps), f".ci/run should run {steps}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_the_docs_state_what_is_true_now(doc):
    """A date inside a record's path (`results/2026-...`) names the record; any other belongs to its history."""
    history = re.findall(r"(?i)\bsessions? \d+|\bissues? \d+|(?<![\w/-])20\d\d-\d\d-\d\d(?![\w-])", doc.read_text())
    assert not history, f"{doc.name}: {history}"


@pytest.mark.parametrize("command", RUN)
def test_the_command_runs_as_written(command, tmp_path):
    python = f"{sys.executable} -m streamfusion_diffusers "
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAMFUSION_RECIPES": str(tmp_path / "recipes")}
    run = subprocess.run(command.replace("streamfusion ", python), shell=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    if command == "streamfusion generate":  # what starts, at once; what the time in all counts
        assert run.stdout.startswith("streamfusion generate: starting tiny-flux"), run.stdout
        assert re.search(r"[\d.]+ s generating, [\d.]+ s around it \(start-up: process and imports [\d.]+ s, join "
                         r"[\d.]+ s, diffusers imports [\d.]+ s, build [\d.]+ s; teardown [\d.]+ s; writing and checks "
                         r"[\d.]+ s\), [\d.]+ s in all\n", run.stdout), run.stdout


@pytest.fixture(scope="module")
def my_flux(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The guide's complete script, copied from the guide and run as it says: `torchrun --nproc-per-node 2
    my_flux.py`, no GPU visible, no weights."""
    script = re.search(r"A complete script \(`my_flux.py`\).*?```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    where = tmp_path_factory.mktemp("my_flux")
    (where / "my_flux.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                          "--master-port", str(free_port()), "my_flux.py"], cwd=where, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return where, run


def test_the_guides_script_gives_the_unparallelized_image(my_flux):
    from PIL import Image

    from streamfusion_diffusers.models.build import build_pipeline

    where, _ = my_flux
    want = build_pipeline("tiny-flux")("a red cat on a quiet street", height=64, width=64, num_inference_steps=2,
                                       generator=torch.Generator("cpu").manual_seed(0)).images[0]
    got = torch.from_numpy(np.asarray(Image.open(where / "cat.png"), dtype=np.float32))
    want = torch.from_numpy(np.asarray(want, dtype=np.float32))
    assert got.shape == want.shape == (64, 64, 3)
    assert relative_error(got, want) < 1e-2  # float32 throughout: the 8-bit rounding of a pixel, now and then


def test_the_guides_script_says_transformers_notices_once(my_flux):
    """Where torchvision is missing transformers says a notice per image processor at diffusers' import, in
    every process: the job says each one once."""
    _, run = my_flux
    notices = [line for line in run.stderr.splitlines() if "requires torchvision" in line]
    if not notices:
        pytest.skip("this environment's transformers says no torchvision notice")
    assert len(notices) == len(set(notices)), "\n".join(notices)

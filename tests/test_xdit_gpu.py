"""The xDiT adapter inside xfuser itself, on 2 GPUs: xfuser's pipelines with ours against its USP and the
unparallelized model (benchmarks/xdit_pipeline.py, checks only), and the command-line path on an xfuser-style
example script. Skipped without 2 GPUs and xfuser (which does not import without a GPU)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("xfuser") is None, reason="needs xfuser (pip install -e '.[xdit]')"),
]

EXAMPLE = '''
import os
import torch
from xfuser import xFuserArgs, xFuserFluxPipeline
from xfuser.config import FlexibleArgumentParser
from streamfusion_diffusers.models.build import build_pipeline


def main():
    args = xFuserArgs.add_cli_args(FlexibleArgumentParser()).parse_args()
    engine_config, input_config = xFuserArgs.from_cli_args(args).create_config()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    pipe = xFuserFluxPipeline(build_pipeline("tiny-flux", dtype=torch.bfloat16, device="cuda"), engine_config)
    pipe(prompt="a fox", height=64, width=64, num_inference_steps=2, output_type="latent", max_sequence_length=16,
         generator=torch.Generator("cuda").manual_seed(0))
    blocks = [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]
    print("PROCESSORS", sorted({type(b.attn.processor).__name__ for b in blocks}), flush=True)


if __name__ == "__main__":
    main()
'''


def torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)


@pytest.mark.parametrize("ulysses, ring", [(2, 1), (1, 2)])
def test_ours_inside_xfusers_pipelines_matches_the_unparallelized_model(tmp_path, ulysses, ring):
    done = torchrun("benchmarks/xdit_pipeline.py", "--ulysses-degree", str(ulysses), "--ring-degree", str(ring),
                    "--skip-timing", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAIL" not in "\n".join(l for l in done.stdout.splitlines() if "xfuser-usp" not in l), done.stdout


def test_command_line_runs_an_xfuser_script_with_our_processors(tmp_path):
    script = tmp_path / "flux_example.py"
    script.write_text(EXAMPLE)
    done = torchrun("-m", "streamfusion_diffusers.xdit", str(script), "--sf-method", "torus", "--model", "tiny",
                    "--ulysses_degree", "2")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "PROCESSORS ['XDiTFluxAttnProcessor']" in done.stdout, done.stdout[-4000:]

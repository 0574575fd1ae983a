"""`streamfusion serve --compile` on 2 gloo ranks: the warm sizes compile before ready, at one image and at the
planner's largest batch, so that no request of them compiles; a request of another size runs, compiling first
(once per batch kind: then the token count is symbolic and no later size compiles), said once with its size and
counted in /metrics, its image the eager one; with two warm sizes no size compiles after ready. On the CPU the
blocks compile with aot_eager (torch's TORCH_COMPILE_OVERRIDE_BACKENDS: inductor's C++ kernels take minutes on a
few cores); the compile cache is checked with inductor on one small graph in a rank process."""
from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from serve_cases import ROOT, Server
from streamfusion_diffusers.diffusers.compiled import use_cache
from streamfusion_diffusers.runtime.pool import ProcessPool

AOT_EAGER = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager"}
SHAPE = ("--model", "tiny-flux", "--machines", "1", "--gpus-per-machine", "2", "--steps", "2")
SERVE = (*SHAPE, "--compile", "--max-batch", "2")
PROMPT = "a red cat"


def ask(server: Server, size: str, n: int = 1) -> tuple[float, np.ndarray]:
    """The seconds a request's call spent compiling (0: none), and its first image."""
    answer = httpx.post(server.url + "/v1/images/generations", timeout=300,
                        json={"prompt": PROMPT, "size": size, "n": n, "seed": 3})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))))
    return body["streamfusion"]["runs"][0]["one_time_s"].get("compile", 0.0), image


def compiled_s(server: Server, size: str, n: int = 1) -> float:
    return ask(server, size, n)[0]


def stalls(server: Server) -> dict[str, float]:
    """/metrics' calls that compiled first, by size."""
    text = httpx.get(server.url + "/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r'streamfusion_compile_stalls_total\{size="(\w+)"\} (\S+)', text)}


def eager_image(tmp_path: Path, width: int, height: int) -> np.ndarray:
    """`generate`'s image of the same job, eager."""
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", *SHAPE, "--prompt", PROMPT, "--seed",
                    "3", "--width", str(width), "--height", str(height), "--output", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return np.asarray(Image.open(tmp_path / "image.png"))


def test_warmed_sizes_never_compile_and_another_compiles_once_said(tmp_path):
    cache = tmp_path / "cache"
    with Server(*SERVE, "--warm-sizes", "64x64", "--compile-cache", str(cache), env=AOT_EAGER) as server:
        assert httpx.get(server.url + "/health").json()["compile_cache"] == str(cache)
        assert compiled_s(server, "64x64") == 0 and compiled_s(server, "64x64", n=2) == 0
        assert compiled_s(server, "48x64") > 0 and compiled_s(server, "48x64") == 0
        assert compiled_s(server, "80x64") == 0  # the tokens are symbolic now
        assert compiled_s(server, "80x64", n=2) > 0 and compiled_s(server, "96x64", n=2) == 0  # at the batch too
        symbolic = ask(server, "96x64")
        assert symbolic[0] == 0
        assert stalls(server) == {"48x64": 1.0, "80x64": 1.0}
        said = [line for line in server.stderr.splitlines() if "to --warm-sizes" in line]
        assert len(said) == 2 and "a request of 48x64 waited" in said[0] and "add 80x64" in said[1], said
    assert np.array_equal(symbolic[1], eager_image(tmp_path, 96, 64))  # the symbolic graph's image is the eager one


def test_two_warm_sizes_leave_no_size_to_compile(tmp_path):
    with Server(*SERVE, "--warm-sizes", "64x64,48x64", "--compile-cache", str(tmp_path), env=AOT_EAGER) as server:
        for size, n in (("80x48", 1), ("80x48", 2), ("96x96", 1), ("64x64", 2)):
            assert compiled_s(server, size, n) == 0, (size, n)
        assert stalls(server) == {}


def inductor_cache_files(folder: str) -> list[str]:
    """In a rank process: one small graph compiled by inductor with its cache under `folder`; the files it left."""
    use_cache(folder)
    torch.compile(lambda x: torch.relu(x) * 2 + 1, fullgraph=True)(torch.ones(8))
    return sorted(str(p.relative_to(folder)).split(os.sep)[0] for p in Path(folder).rglob("*") if p.is_file())


def test_inductor_keeps_its_compiles_in_the_cache_folder(tmp_path):
    with ProcessPool(1) as pool:
        found = pool.run(inductor_cache_files, str(tmp_path))[0]
    assert "fxgraph" in found and "aotautograd" in found, found

"""`streamfusion serve --model tiny-flux --lora a=...:8 --lora b=...:6` on 4 gloo ranks: a request's `lora` field
picks the named adapters (unfused, switched on every rank before the call). Two requests naming a and b give two
different images, each the image `generate --lora` gives with that LoRA fused (equal up to the float rounding of
fused weights against the adapter's separate matmuls) and pixel-identical to `generate --lora NAME=PATH`, which
runs the same unfused adapter; no lora gives plain generate's image exactly; an unknown name is refused with 400
before any rank runs; a batch of mixed adapters gives each request its own image."""
from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from serve_cases import ROOT, Server
from stack_cases import make_lora

PROMPT, SEED, STEPS = "a lighthouse on a cliff at dawn", 3, 4
A_SCALE, B_SCALE = 8.0, 6.0  # the default weights on the server: the tiny random LoRAs change little at 1
FUSED_LEVELS = 2  # fused weights against the adapter's own matmuls: float32 rounding, at most a level or two


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("peft", reason="LoRAs need peft (the lora extra)")
    return {name: make_lora(tmp_path_factory.mktemp(f"lora-{name}"), seed=seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def server(loras):
    with Server("--model", "tiny-flux", "--steps", str(STEPS), "--batch-wait-ms", "200", "--lora",
                f"a={loras['a']}:{A_SCALE}", "--lora", f"b={loras['b']}:{B_SCALE}") as s:
        yield s


def generated(tmp_path, *argv: str) -> np.ndarray:
    """`streamfusion generate --model tiny-flux` with the same prompt, seed and steps, plus `argv`."""
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", "tiny-flux", "--prompt",
                    PROMPT, "--seed", str(SEED), "--steps", str(STEPS), "--output", str(tmp_path), *argv], cwd=ROOT,
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    return np.asarray(Image.open(tmp_path / "image.png"))


def served(url: str, lora=None, seed: int = SEED) -> tuple[np.ndarray, dict]:
    body = {"prompt": PROMPT, "seed": seed, **({} if lora is None else {"lora": lora})}
    answer = httpx.post(url + "/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    run = answer.json()["streamfusion"]["runs"][0]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))), run


def levels(x: np.ndarray, y: np.ndarray) -> int:
    return int(np.abs(x.astype(int) - y.astype(int)).max())


def test_two_named_loras_give_two_images_each_the_one_generate_gives(server, loras, tmp_path):
    a, run_a = served(server.url, "a")
    b, run_b = served(server.url, [{"name": "b"}])
    plain, run_plain = served(server.url)
    assert run_a["lora"]["adapters"] == [{"name": "a", "scale": A_SCALE}]
    assert run_b["lora"]["adapters"] == [{"name": "b", "scale": B_SCALE}] and run_plain["lora"]["adapters"] == []
    assert levels(a, b) > 10 * FUSED_LEVELS and levels(a, plain) > 10 * FUSED_LEVELS  # the LoRAs change the image
    assert np.array_equal(b, generated(tmp_path / "named-b", "--lora", f"b={loras['b']}:{B_SCALE}"))
    again, _ = served(server.url, f"a:{A_SCALE}")  # switched back: the same pixels
    assert np.array_equal(a, again)


@pytest.mark.slow  # a third generate run: the served LoRA against generate's fused one
def test_a_served_lora_is_generates_fused_lora_within_rounding(server, loras, tmp_path):
    a, _ = served(server.url, "a")
    assert levels(a, generated(tmp_path / "fused-a", "--lora", f"{loras['a']}:{A_SCALE}")) <= FUSED_LEVELS


def test_a_scale_in_the_request_weights_the_lora(server):
    half, run = served(server.url, "a:0.5")
    full, _ = served(server.url, "a:1")
    off, _ = served(server.url, "a:0")
    plain, _ = served(server.url)
    assert run["lora"]["adapters"] == [{"name": "a", "scale": 0.5}]
    assert levels(half, full) > 0 and levels(half, plain) > 0
    assert np.array_equal(off, plain)


@pytest.mark.parametrize(("lora", "message"), [
    ("c", "lora 'c': no such LoRA; this server has 'a', 'b'"),
    (["a", "a:0.5"], "lora 'a': named twice"),
    ("a:x", "the scale 'x' is not a number"),
    ([{"name": "a", "weight": 1}], "weight: extra inputs are not permitted"),
    ("a:11", "lora 'a' scale 11: must be from -10 to 10"),
])
def test_a_bad_lora_is_refused_with_400_naming_the_field(server, lora, message):
    answer = httpx.post(server.url + "/v1/images/generations", json={"prompt": PROMPT, "lora": lora}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "lora" and message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_a_batch_of_mixed_loras_gives_each_request_its_own_image(server):
    asked = ["a", "b", None, "a", "b"]
    alone = [served(server.url, lora, seed=SEED + i)[0] for i, lora in enumerate(asked)]
    with ThreadPoolExecutor(len(asked)) as pool:
        together = list(pool.map(lambda i: served(server.url, asked[i], seed=SEED + i), range(len(asked))))
    assert max(run["batch"] for _, run in together) > 1, "no batch formed"
    for (image, run), single, lora in zip(together, alone, asked):
        assert np.array_equal(image, single), (lora, run["batch"])
        assert [x["name"] for x in run["lora"]["adapters"]] == ([lora] if lora else [])


def test_the_example_lora_moves_pixels_by_tens_of_levels_at_scale_1_and_less_at_half(tmp_path):
    """examples/make_tiny_lora.py, the one-command LoRA to try `--lora` with: at scale 1 the image moves by tens
    of levels (peft's random weights alone move it by a few), at 0.5 visibly less."""
    pytest.importorskip("peft", reason="LoRAs need peft (the lora extra)")
    folder = tmp_path / "lora"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_lora.py"), str(folder)], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    plain = generated(tmp_path / "plain").astype(int)
    moved = {scale: np.abs(generated(tmp_path / scale, "--lora", f"{folder}:{scale}").astype(int) - plain)
             for scale in ("1", "0.5")}
    assert moved["1"].max() >= 40 and moved["1"].mean() >= 5, (moved["1"].max(), moved["1"].mean())
    assert 0 < moved["0.5"].mean() < 0.75 * moved["1"].mean(), (moved["0.5"].mean(), moved["1"].mean())

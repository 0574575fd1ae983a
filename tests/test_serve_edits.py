"""`streamfusion serve` of the tiny edit models on 4 gloo ranks takes OpenAI's image edits: the openai client's
`images.edit` gets an image of the asked size, pixel-identical to `generate --image` with the same seed (and not
the image made without the input); a streamed edit has a progress event per step, then the unstreamed edit's
image, also through the openai client; a file that is no image and a mask get 400 naming the field (Kontext's
server); the page's edit form, in a real browser, edits an image the page made (progress, the image, the history);
`generate --image` on 4 ranks gives one rank's image."""
from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from serve_cases import ROOT, Server, browser_page

MODEL = "tiny-flux-kontext"
PROMPT = "a red cat on a quiet street"


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("input") / "photo.png"
    pixels = np.random.default_rng(7).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.fixture(scope="module")
def server():
    with Server("--model", MODEL) as s:
        yield s


def generate(out, *argv: str, model: str = MODEL) -> np.ndarray:
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", model, "--prompt", PROMPT,
                    "--output", str(out), *argv], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return np.asarray(Image.open(out / "image.png"))


def edit(url: str, model: str, photo: str) -> np.ndarray:
    client = openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0)
    with open(photo, "rb") as image:
        answer = client.images.edit(model=model, image=image, prompt=PROMPT, size="64x48",
                                    response_format="b64_json", extra_body={"seed": 5})
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))))


def test_an_edit_through_the_openai_client_equals_generate_with_the_image(server, photo, tmp_path):
    served = edit(server.url, MODEL, photo)
    assert served.shape == (48, 64, 3)
    generated = generate(tmp_path, "--image", photo, "--seed", "5", "--height", "48", "--width", "64")
    assert np.array_equal(served, generated)
    plain = generate(tmp_path / "plain", "--seed", "5", "--height", "48", "--width", "64")
    assert not np.array_equal(served, plain)  # the input image was really taken


@pytest.mark.slow  # the edit route is the Kontext test's; Qwen-Image-Edit's plan is checked in test_plans_p4
def test_a_qwen_image_edit_through_the_openai_client_equals_generate(photo, tmp_path):
    """Qwen-Image-Edit reads the image twice (its VAE's latents beside the image's tokens, and its Qwen2-VL
    encoder's prompt through the offline processor)."""
    model = "tiny-qwen-image-edit"
    with Server("--model", model) as qwen:
        served = edit(qwen.url, model, photo)
    assert served.shape == (48, 64, 3)
    generated = generate(tmp_path, "--image", photo, "--seed", "5", "--height", "48", "--width", "64", model=model)
    assert np.array_equal(served, generated)


def test_a_streamed_edit_has_a_progress_event_per_step_then_the_unstreamed_edit(server, photo):
    with open(photo, "rb") as f:
        data = f.read()
    form = {"prompt": PROMPT, "seed": "5", "size": "64x48", "num_inference_steps": "5"}
    files = {"image": ("photo.png", data, "image/png")}
    events = []
    with httpx.stream("POST", server.url + "/v1/images/edits", files=files, timeout=60,
                      data={**form, "stream": "true", "partial_images": "2"}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                found = json.loads(line[len("data: "):])
                assert found["type"] == kind
                events.append((kind, found))
    kinds = [k for k, _ in events]
    assert kinds.count("image_edit.completed") == 1 and kinds[-1] == "image_edit.completed", kinds
    assert [d["step"] for k, d in events if k == "image_edit.progress"] == [1, 2, 3, 4, 5]
    assert [d["partial_image_index"] for k, d in events if k == "image_edit.partial_image"] == [0, 1]
    plain = httpx.post(server.url + "/v1/images/edits", files=files, data=form, timeout=60)
    assert plain.status_code == 200, plain.text
    final = base64.b64decode(events[-1][1]["b64_json"])
    assert Image.open(io.BytesIO(final)).size == (64, 48)
    assert final == base64.b64decode(plain.json()["data"][0]["b64_json"])


def test_the_openai_client_streams_an_edit(server, photo):
    client = openai.OpenAI(api_key="none", base_url=server.url + "/v1", max_retries=0)
    with open(photo, "rb") as image:
        stream = client.images.edit(model=MODEL, image=image, prompt=PROMPT, size="64x48", stream=True,
                                    extra_body={"seed": 5, "num_inference_steps": 3})
        events = list(stream)
    assert [e.type for e in events] == ["image_edit.progress"] * 3 + ["image_edit.completed"]
    final = events[-1]
    assert final.size == "64x48" and Image.open(io.BytesIO(base64.b64decode(final.b64_json))).size == (64, 48)


@pytest.mark.parametrize(("files", "param", "words"), [
    ({"image": ("notes.png", b"these are no pixels", "image/png")}, "image", "not an image"),
    ({"mask": ("mask.png", None, "image/png")}, "mask", "takes no mask"),
])
def test_bad_uploads_get_400_naming_the_field(server, photo, files, param, words):
    with open(photo, "rb") as f:
        data = f.read()
    sent = {"image": ("photo.png", data, "image/png"),
            **{k: (n, data if b is None else b, t) for k, (n, b, t) in files.items()}}
    answer = httpx.post(server.url + "/v1/images/edits", files=sent, data={"prompt": PROMPT}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert " object at 0x" not in error["message"], error  # no Python object's repr in what a client reads


def test_an_edit_sent_as_json_is_told_the_one_type_the_route_takes(server):
    answer = httpx.post(server.url + "/v1/images/edits", json={"prompt": PROMPT}, timeout=60)
    assert answer.status_code == 415, answer.text
    message = answer.json()["error"]["message"]
    assert "takes multipart/form-data (curl: -F image=@" in message, message
    assert message.count("application/json") == 1, message  # as what was sent, not as what the route takes


def test_the_page_edits_an_image_it_made_in_a_real_browser(server):
    with browser_page() as page:
        page.goto(server.url + "/")
        assert page.is_visible("#form") and page.is_visible("#edit") and not page.is_visible("#key")
        page.fill("#seed", "3")
        page.fill("#height", "48")
        page.click("#generate")
        page.wait_for_selector("#generate:not([disabled])", timeout=60_000)
        made = base64.b64decode(page.eval_on_selector("#result", "img => img.src").split(",", 1)[1])
        page.set_input_files("#edit-image", {"name": "made.png", "mimeType": "image/png", "buffer": made})
        page.wait_for_function("document.getElementById('edit-height').value === '48'", timeout=10_000)
        page.fill("#edit-seed", "4")
        page.fill("#edit-steps", "8")
        page.evaluate("""() => { window.seen = [];
            new MutationObserver(() => window.seen.push(Number(document.getElementById("progress").value)))
                .observe(document.getElementById("progress"), { attributes: true }); }""")
        page.click("#go-edit")
        page.wait_for_selector("#go-edit:not([disabled])", timeout=60_000)
        status = page.text_content("#status")
        edited = page.eval_on_selector("#result", "img => [img.alt, img.naturalWidth, img.naturalHeight, img.src]")
        seen = [v for v in page.evaluate("window.seen") if v > 0]
        history = page.eval_on_selector_all("#history li", "items => items.map(li => li.textContent)")
        prompt = page.input_value("#edit-prompt")
    assert edited[:3] == ["edited image", 64, 48], status
    assert "seed 4" in status, status
    assert len(set(seen)) > 3 and seen == sorted(seen) and seen[-1] == 8, seen
    assert len(history) == 2 and history[0].startswith("edit, seed 4:") and history[1].startswith("seed 3:"), history
    form = {"prompt": prompt, "seed": "4", "size": "64x48", "num_inference_steps": "8"}
    plain = httpx.post(server.url + "/v1/images/edits", files={"image": ("made.png", made, "image/png")}, data=form,
                       timeout=60)
    assert base64.b64decode(edited[3].split(",", 1)[1]) == base64.b64decode(plain.json()["data"][0]["b64_json"])


@pytest.mark.slow  # the plans' exactness with input images on 4 ranks is test_plans_p4's, layout by layout
def test_generate_with_an_image_on_4_ranks_equals_one_rank(photo, tmp_path):
    one = generate(tmp_path / "one", "--image", photo, "--machines", "1", "--gpus-per-machine", "1")
    four = generate(tmp_path / "four", "--image", photo)
    assert one.shape == four.shape == (64, 64, 3)
    assert np.abs(one.astype(int) - four.astype(int)).max() <= 1

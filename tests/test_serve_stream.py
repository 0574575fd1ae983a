"""`streamfusion serve --model tiny-flux` on 4 gloo ranks, streamed: a request with `"stream": true` gets a progress
event per step, its previews as PNGs, then the image it gets unstreamed; the openai client reads the stream; a
client that leaves mid-stream frees the group; the page shows the progress bar, the previews and its history in
a real browser."""
from __future__ import annotations

import base64
import io
import json

import httpx
import openai
import pytest
from PIL import Image

from serve_cases import Server, browser_page

from streamfusion_diffusers.runtime.progress import preview_steps


@pytest.fixture(scope="module")
def server():
    with Server("--model", "tiny-flux", "--max-steps", "2000") as s:
        yield s


def _events(url: str, body: dict, stop_after: int | None = None) -> list[tuple[str, dict]]:
    """The stream's (event, data) pairs; with `stop_after`, the client leaves after that many progress events."""
    found: list[tuple[str, dict]] = []
    with httpx.stream("POST", url + "/v1/images/generations", json={**body, "stream": True}, timeout=60) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data.get("type", kind) == kind or kind == "error"
                found.append((kind, data))
                if stop_after is not None and sum(k == "image_generation.progress" for k, _ in found) >= stop_after:
                    break
    return found


def _png(b64: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return image


def _metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_a_streamed_request_has_a_progress_event_per_step_then_the_unstreamed_image(server):
    body = {"prompt": "a red fox", "seed": 7, "num_inference_steps": 5, "size": "64x48"}
    events = _events(server.url, {**body, "partial_images": 2})
    kinds = [k for k, _ in events]
    assert kinds[-1] == "image_generation.completed" and kinds.count("image_generation.completed") == 1
    progress = [d for k, d in events if k == "image_generation.progress"]
    assert [d["step"] for d in progress] == [1, 2, 3, 4, 5] and {d["steps"] for d in progress} == {5}
    assert all(a["elapsed_s"] <= b["elapsed_s"] for a, b in zip(progress, progress[1:]))
    partials = [d for k, d in events if k == "image_generation.partial_image"]
    assert [d["partial_image_index"] for d in partials] == list(range(len(preview_steps(5, 2)))) == [0, 1]
    for partial in partials:
        assert _png(partial["b64_json"]).size[0] > 0
    drawn_at = [kinds[:i].count("image_generation.progress") for i, k in enumerate(kinds)
                if k == "image_generation.partial_image"]
    assert drawn_at == sorted(preview_steps(5, 2)) == [1, 3]  # each preview right after its step's progress
    final = events[-1][1]
    assert _png(final["b64_json"]).size == (64, 48) and final["size"] == "64x48"
    plain = httpx.post(server.url + "/v1/images/generations", json=body, timeout=60).json()
    assert base64.b64decode(final["b64_json"]) == base64.b64decode(plain["data"][0]["b64_json"])


def test_the_openai_client_streams_partial_images_and_the_image(server):
    client = openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0)
    stream = client.images.generate(model="tiny-flux", prompt="a lighthouse", size="64x64", stream=True,
                                    partial_images=2, extra_body={"seed": 3, "num_inference_steps": 6})
    events = list(stream)
    assert [e.type for e in events].count("image_generation.progress") == 6
    partials = [e for e in events if e.type == "image_generation.partial_image"]
    assert [e.partial_image_index for e in partials] == [0, 1]
    assert events[-1].type == "image_generation.completed" and _png(events[-1].b64_json).size == (64, 64)


def test_a_stream_in_jpeg_has_its_previews_and_image_in_jpeg(server):
    events = _events(server.url, {"prompt": "a red fox", "seed": 7, "num_inference_steps": 5, "size": "64x48",
                                  "partial_images": 1, "output_format": "jpeg", "output_compression": 90})
    images = [d for k, d in events if k in ("image_generation.partial_image", "image_generation.completed")]
    assert len(images) == 2 and all(d["output_format"] == "jpeg" for d in images)
    assert all(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).format == "JPEG" for d in images)


def test_stream_refusals_name_the_field(server):
    for body, field in (({"n": 2}, "n"), ({"partial_images": 4}, "partial_images")):
        answer = httpx.post(server.url + "/v1/images/generations", timeout=30,
                            json={"prompt": "a fox", "stream": True, **body})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


def test_a_client_that_leaves_mid_stream_frees_the_group(server):
    cancelled = _metric(server.url, "streamfusion_cancelled_total")
    events = _events(server.url, {"prompt": "a fox", "seed": 1, "num_inference_steps": 2000}, stop_after=3)
    assert [k for k, _ in events] == ["image_generation.progress"] * 3
    after = httpx.post(server.url + "/v1/images/generations", timeout=60,
                       json={"prompt": "a fox", "seed": 2, "num_inference_steps": 2})
    assert after.status_code == 200
    ran = after.json()["streamfusion"]
    step_s = max(ran["runs"][0]["step_latency_s"])
    # the 2000 steps stopped: the next waited for a few of them, not for the rest (both paced by the same load)
    assert ran["queued_s"] < 100 * step_s, (ran["queued_s"], step_s)
    assert _metric(server.url, "streamfusion_cancelled_total") == cancelled + 1
    assert _metric(server.url, "streamfusion_restarts_total") == 0


def test_the_page_shows_progress_previews_and_its_history_in_a_real_browser(server):
    with browser_page() as page:
        page.goto(server.url + "/")
        page.fill("#steps", "40")
        page.evaluate("""() => {
            new MutationObserver(() => window.seen.push(Number(document.getElementById("progress").value)))
                .observe(document.getElementById("progress"), { attributes: true });
            new MutationObserver(() => document.getElementById("preview").src && window.previews++)
                .observe(document.getElementById("preview"), { attributes: true, attributeFilter: ["src"] });
        }""")
        made, seen, previews = [], [], []
        for seed in ("5", "6"):
            page.evaluate("window.seen = []; window.previews = 0")
            page.fill("#seed", seed)
            page.click("#generate")
            page.wait_for_selector("#generate:not([disabled])", timeout=60_000)
            made.append(page.eval_on_selector("#result", "img => img.naturalWidth"))
            seen.append([v for v in page.evaluate("window.seen") if v > 0])
            previews.append(page.evaluate("window.previews"))
        history = page.eval_on_selector_all("#history li", "items => items.map(li => li.textContent)")
        thumbnails = page.eval_on_selector_all("#history img", "imgs => imgs.map(i => i.naturalWidth)")
        status = page.text_content("#status")
    assert made == [64, 64], status
    for moved in seen:  # the bar moved forward step by step to the last
        assert len(set(moved)) > 5 and moved == sorted(moved) and moved[-1] == 40, moved
    assert previews == [3, 3]
    assert len(history) == 2 and history[0].startswith("seed 6:") and history[1].startswith("seed 5:"), history
    assert all(w > 0 for w in thumbnails)

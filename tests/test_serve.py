"""`streamfusion serve --model tiny-flux` on 4 gloo ranks, one server for the module, talked to on loopback as
users do: the official openai client, curl-like requests (httpx), a real browser for the page."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from serve_cases import ROOT, Server, browser_page

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "a lighthouse on a cliff at dawn"
MAX_QUEUE = 3
PAGES = "http://pages.example:3000"  # the one --allow-origin
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with Server("--model", "tiny-flux", "--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--max-n", "2",
                "--max-steps", "400", "--request-timeout", "8", "--allow-origin", PAGES) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key=KEY, base_url=server.url + "/v1", max_retries=0)


def png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_ready_line_and_health(server):
    assert server.layout == "usp 2x2 U2R2, torch over gloo"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ready" and health.json()["groups"][0]["ranks"] == 4
    assert "pids" not in health.json()["groups"][0]  # no key needed for /health: it says nothing of processes
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-flux"


def test_openai_client_generates_images(client):
    answer = client.images.generate(model="tiny-flux", prompt=PROMPT, n=2, size="64x48", response_format="b64_json",
                                    extra_body={"seed": 11, "num_inference_steps": 3})
    images = [png(d.b64_json) for d in answer.data]
    assert [i.shape for i in images] == [(48, 64, 3)] * 2
    assert not np.array_equal(images[0], images[1])  # seeds 11 and 12
    ran = answer.model_extra["streamfusion"]
    assert ran["seeds"] == [11, 12]
    assert [r["seed"] for r in ran["runs"]] == [11, 12]
    run = ran["runs"][0]
    assert run["layout"] == "usp 2x2 U2R2" and len(run["step_latency_s"]) == 3
    assert run["output_size"] == {"height": 48, "width": 64} and run["build_s"] == 0.0


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 3,
                                  pytest.param(12345, marks=pytest.mark.slow)])  # 3: the default run's seed
def test_a_served_image_is_pixel_identical_to_generate(client, tmp_path, seed):
    subprocess.run([sys.executable, "-m", "streamfusion_diffusers", "generate", "--model", "tiny-flux", "--prompt",
                    PROMPT, "--seed", str(seed), "--output", str(tmp_path)], cwd=ROOT, check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    generated = np.asarray(Image.open(tmp_path / "image.png"))
    # random weights have their own seed (--weights-seed, default 0) in both: only the noise follows the seed
    answer = client.images.generate(model="tiny-flux", prompt=PROMPT, response_format="b64_json",
                                    extra_body={"seed": seed})
    served = png(answer.data[0].b64_json)
    assert served.shape == generated.shape
    assert np.array_equal(served, generated)
    run = json.loads((tmp_path / "run.json").read_text())
    ran = answer.model_extra["streamfusion"]["runs"][0]
    assert ran["layout"] == run["layout"] and ran["weights_seed"] == run["weights_seed"] == 0


BAD = [  # (body, status, param, words the message must hold)
    ("{not json", 400, None, "not valid JSON"),
    ("[1, 2]", 400, None, "not an object"),
    ({}, 400, "prompt", "missing"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": 7}, 400, "prompt", "must be a string"),
    ({"prompt": "x" * 4001}, 400, "prompt", "at most 4000"),
    ({"prompt": "a", "model": "flux-pro"}, 404, "model", "tiny-flux"),
    ({"prompt": "a", "n": 0}, 400, "n", "from 1 to 2"),
    ({"prompt": "a", "n": 3}, 400, "n", "from 1 to 2"),
    ({"prompt": "a", "n": "2"}, 400, "n", "integer"),
    ({"prompt": "a", "n": True}, 400, "n", "integer"),
    ({"prompt": "a", "size": "64"}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "0x64"}, 400, "size", "positive multiples of 4"),
    ({"prompt": "a", "size": "62x64"}, 400, "size", "multiples of 4"),
    ({"prompt": "a", "size": "4096x4096"}, 400, "size", "at most 65536"),
    ({"prompt": "a", "size": "4x4"}, 400, "size", "fewer than the 4 ranks"),
    ({"prompt": "a", "size": [64, 64]}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "num_inference_steps": 0}, 400, "num_inference_steps", "from 1 to 400"),
    ({"prompt": "a", "num_inference_steps": 401}, 400, "num_inference_steps", "from 1 to 400"),
    ({"prompt": "a", "num_inference_steps": 2.5}, 400, "num_inference_steps", "integer"),
    ({"prompt": "a", "seed": -1}, 400, "seed", "from 0"),
    ({"prompt": "a", "seed": "7"}, 400, "seed", "integer"),
    ({"prompt": "a", "seed": 2**64}, 400, "seed", "from 0 to"),
    ({"prompt": "a", "guidance_scale": "high"}, 400, "guidance_scale", "number"),
    ({"prompt": "a", "guidance_scale": 1000}, 400, "guidance_scale", "from 0 to 100"),
    ({"prompt": "a", "negative_prompt": "blurry"}, 400, "negative_prompt", "guidance"),
    ({"prompt": "a", "response_format": "url"}, 400, "response_format", "b64_json"),
    ({"prompt": "a", "output_format": "gif"}, 400, "output_format", "'webp'"),
    ({"prompt": "a", "output_format": "jpeg", "output_compression": 101}, 400, "output_compression", "from 0 to 100"),
    ({"prompt": "a", "quality": "ultra"}, 400, "quality", "'hd'"),
    ({"prompt": "a", "background": "transparent"}, 400, "background", "opaque"),
    ({"prompt": "a", "stream": True, "n": 2}, 400, "n", "stream true"),
    ({"prompt": "a", "user": 7}, 400, "user", "must be a string"),
    ({"prompt": "a", "image_path": "/etc/passwd"}, 400, "image_path", "unknown field"),
    ({"prompt": "a", "num_frames": 9}, 400, "num_frames", "unknown field"),
]


def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_stays_up(server):
    with httpx.Client(base_url=server.url, headers=AUTH) as http:
        for body, status, param, words in BAD:
            content = body if isinstance(body, str) else json.dumps(body)
            answer = http.post("/v1/images/generations", content=content, headers=JSON)
            error = answer.json()["error"]
            assert answer.status_code == status, (body, answer.text)
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["param"] == param and words in error["message"], (body, error)
        big = http.post("/v1/images/generations", content=b" " * (2 << 20), headers=JSON)
        assert big.status_code == 413 and "1048576 bytes" in big.json()["error"]["message"]
        assert http.post("/v1/videos", json={"prompt": "a"}).json()["error"]["param"] == "model"
        assert http.get("/v1/nowhere").status_code == 404 and "error" in http.get("/v1/nowhere").json()
        assert http.get("/health").status_code == 200
        assert http.post("/v1/images/generations", json={"prompt": "a", "seed": 1}).status_code == 200


def test_every_v1_route_needs_the_api_key(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a"},
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="nope", base_url=server.url + "/v1", max_retries=0).images.generate(prompt="a")
    assert httpx.get(server.url + "/health").status_code == 200  # not under /v1: for load balancers
    assert httpx.get(server.url + "/metrics").status_code == 200


def _burst(url: str, count: int, clients: int) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        return httpx.post(url + "/v1/images/generations", headers=AUTH, timeout=60,
                          json={"prompt": f"{PROMPT} {i}", "seed": i, "num_inference_steps": 2})

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(count)))


def _refused(url: str) -> float:
    """/metrics' count of image requests answered 429 so far."""
    found = re.search(r'streamfusion_requests_total\{route="/v1/images/generations",status="429"\} (\S+)',
                      httpx.get(url + "/metrics").text)
    return float(found[1]) if found else 0.0


def test_load_every_answer_is_200_or_429_none_lost_and_memory_flat(server):
    counted = _refused(server.url)
    warm = _burst(server.url, 16, 8)  # warm: every size of buffer allocated once
    before = server.rss_bytes()
    answers = _burst(server.url, 50, 8)
    grown = server.rss_bytes() - before
    assert len(answers) == 50
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= MAX_QUEUE, codes  # the queue took some; the rest were told to retry
    for answer in answers:
        if answer.status_code == 429:
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.json()["error"]["code"] == "queue_full"
        else:
            assert png(answer.json()["data"][0]["b64_json"]).shape == (64, 64, 3)
    assert grown < 64 * 2**20, f"the server and its ranks grew by {grown / 2**20:.0f} MiB over 50 requests"
    refused = sum(a.status_code == 429 for a in warm + answers)  # how many depends on the machine's speed
    deadline = time.monotonic() + 5  # a request is counted once its answer is sent: the last may lag the client
    while _refused(server.url) - counted != refused and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _refused(server.url) - counted == refused
    assert "streamfusion_queue_depth 0" in httpx.get(server.url + "/metrics").text


def test_a_client_that_leaves_before_its_request_starts_is_dropped(server):
    def dropped() -> int:
        line = next(x for x in httpx.get(server.url + "/metrics").text.splitlines()
                    if x.startswith("streamfusion_dropped_total"))
        return int(float(line.split()[1]))

    before = dropped()
    long = threading.Thread(target=lambda: httpx.post(server.url + "/v1/images/generations", headers=AUTH,
                                                      json={"prompt": "a", "num_inference_steps": 40}, timeout=60))
    long.start()
    time.sleep(0.5)
    with pytest.raises(httpx.ReadTimeout):  # waits behind the long one, then its client gives up
        httpx.post(server.url + "/v1/images/generations", headers=AUTH, json={"prompt": "b"}, timeout=0.5)
    long.join()
    assert dropped() == before + 1


def test_a_request_past_the_timeout_gets_504_and_the_ranks_stay_in_step(server):
    late = httpx.post(server.url + "/v1/images/generations", headers=AUTH, timeout=60,
                      json={"prompt": "a", "num_inference_steps": 400})
    assert late.status_code == 504 and late.json()["error"]["code"] == "timeout", late.text
    stopped = re.search(r"stopped after step (\d+) of 400", late.json()["error"]["message"])
    assert stopped and int(stopped[1]) < 400, late.text  # stopped at the deadline, not run to its end
    after = httpx.post(server.url + "/v1/images/generations", headers=AUTH, json={"prompt": "a", "seed": 3},
                       timeout=60)
    assert after.status_code == 200  # the same ranks, no restart
    assert "streamfusion_restarts_total 0" in httpx.get(server.url + "/metrics").text


def test_the_page_generates_an_image_in_a_real_browser(server):
    with browser_page() as page:
        page.goto(server.url + "/")
        assert page.text_content("#model") == "tiny-flux"
        page.fill("#key", KEY)
        page.fill("#seed", "5")
        page.click("#generate")
        page.wait_for_selector("#result", timeout=60_000)
        width = page.eval_on_selector("#result", "img => img.naturalWidth")
        status = page.text_content("#status")
        ran = json.loads(page.text_content("#ran"))
    assert width == 64
    assert "usp 2x2 U2R2" in status and "seed 5" in status
    assert ran["runs"][0]["seed"] == 5


def test_openai_fields_clients_send_are_taken_and_the_ignored_ones_said(client):
    answer = client.images.generate(model="tiny-flux", prompt=PROMPT, size="64x64", quality="hd", style="vivid",
                                    user="someone", moderation="low", output_format="png", response_format="b64_json",
                                    extra_body={"seed": 4, "num_inference_steps": 2})
    assert png(answer.data[0].b64_json).shape == (64, 64, 3)
    ignored = answer.model_extra["streamfusion"]["ignored"]
    assert set(ignored) == {"quality", "style", "user", "moderation"}, ignored
    assert "num_inference_steps" in ignored["quality"]


def test_images_come_as_jpeg_or_webp_when_asked_at_the_quality_asked(client):
    """OpenAI's output_format and output_compression: the same image as the PNG one, encoded lossy (a JPEG of
    quality 100 within a few levels of it, a smaller one at 30), and the answer says which format it holds."""
    def ask(**fields):
        answer = client.images.generate(model="tiny-flux", prompt=PROMPT, size="64x64", response_format="b64_json",
                                        extra_body={"seed": 9, "num_inference_steps": 2}, **fields)
        return answer, base64.b64decode(answer.data[0].b64_json)

    lossless, kept = ask(output_compression=30)
    assert kept[:8] == b"\x89PNG\r\n\x1a\n" and lossless.output_format == "png"
    assert "output_compression" in lossless.model_extra["streamfusion"]["ignored"]
    pixels = np.asarray(Image.open(io.BytesIO(kept)), dtype=np.float64)
    sizes = {}
    for fmt, quality, magic in (("jpeg", 100, b"\xff\xd8\xff"), ("jpeg", 30, b"\xff\xd8\xff"), ("webp", 90, b"RIFF")):
        answer, data = ask(output_format=fmt, output_compression=quality)
        assert data.startswith(magic) and answer.output_format == fmt, (fmt, data[:12])
        assert "ignored" not in answer.model_extra["streamfusion"]
        image = Image.open(io.BytesIO(data))
        assert image.format == {"jpeg": "JPEG", "webp": "WEBP"}[fmt] and image.size == (64, 64)
        sizes[fmt, quality] = len(data)
        if quality == 100:
            assert np.abs(np.asarray(image, dtype=np.float64) - pixels).mean() < 4  # the same image, lossy
    assert sizes["jpeg", 30] < sizes["jpeg", 100]


def test_a_page_of_another_site_cannot_post_json_forms_or_text(server):
    """What a page may send without asking first (a form, text/plain) is refused, so is its Origin; a Host that
    is not loopback's (DNS rebinding) is refused before anything else."""
    url = server.url + "/v1/images/generations"
    body = json.dumps({"prompt": "a", "num_inference_steps": 1})
    text = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "text/plain"})
    assert text.status_code == 415 and text.json()["error"]["code"] == "unsupported_media_type"
    assert 'Content-Type: application/json' in text.json()["error"]["message"]
    form = httpx.post(url, data={"prompt": "a"}, headers={**AUTH, "Origin": "http://evil.example"})
    assert form.status_code == 403 and "--allow-origin http://evil.example" in form.json()["error"]["message"]
    bare_form = httpx.post(url, data={"prompt": "a"}, headers=AUTH)  # no Origin (not a browser): still not JSON
    assert bare_form.status_code == 415
    videos = httpx.post(server.url + "/v1/videos", files={"prompt": (None, "a")},
                        headers={**AUTH, "Origin": "http://evil.example"})
    assert videos.status_code == 403
    port = server.url.rsplit(":", 1)[1]
    forged = httpx.get(server.url + "/health", headers={"Host": f"evil.example:{port}"})
    assert forged.status_code == 421 and "loopback" in forged.json()["error"]["message"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", "LOCALHOST"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200, host
    same = httpx.post(url, json={"prompt": "a", "num_inference_steps": 1, "seed": 1},
                      headers={**AUTH, "Origin": server.url})  # the page at / posts from its own origin
    assert same.status_code == 200


def test_cors_preflight_is_answered_only_for_allowed_origins(server):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(server.url + "/v1/images/generations", headers={**ask, "Origin": PAGES})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == PAGES
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    other = httpx.options(server.url + "/v1/images/generations", headers={**ask, "Origin": "http://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    assert other.json()["error"]["code"] == "origin_not_allowed"
    unauthorized = httpx.get(server.url + "/v1/models", headers={"Origin": PAGES})
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == PAGES
    ran = httpx.get(server.url + "/v1/models", headers={**AUTH, "Origin": PAGES})
    assert ran.status_code == 200 and ran.headers["access-control-allow-origin"] == PAGES


def test_every_answer_has_a_request_id_the_access_log_names(server):
    given = httpx.get(server.url + "/v1/models", headers={**AUTH, "X-Request-Id": "client-7"})
    assert given.headers["x-request-id"] == "client-7"
    made = httpx.post(server.url + "/v1/images/generations", headers=AUTH,
                      json={"prompt": "a", "size": "64x48", "num_inference_steps": 2, "seed": 2})
    refused = httpx.get(server.url + "/v1/models")
    assert refused.status_code == 401 and refused.headers["x-request-id"].startswith("req_")
    request_id = made.headers["x-request-id"]
    ends = time.monotonic() + 5
    while request_id not in server.stderr and time.monotonic() < ends:
        time.sleep(0.1)
    line = next(x for x in server.stderr.splitlines() if request_id in x)
    assert "POST /v1/images/generations 200 " in line and "size=64x48 steps=2" in line, line
    assert "client-7 GET /v1/models 200" in server.stderr


def test_the_bearer_scheme_is_matched_in_any_case(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code == 401

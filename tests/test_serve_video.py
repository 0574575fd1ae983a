"""`streamfusion serve --model tiny-wan --replicas 2`: the video routes through the official openai client, and
two parallel groups of 2 gloo ranks each serving requests at once behind one queue."""
from __future__ import annotations

import io
import os
import signal
import time

import httpx
import imageio.v3 as iio
import numpy as np
import openai
import pytest
from PIL import Image

from serve_cases import Server, browser_page


@pytest.fixture(scope="module")
def server():
    with Server("--model", "tiny-wan", "--replicas", "2") as s:
        yield s


def test_two_groups_of_two_ranks(server):
    assert server.layout.startswith("2 x ")
    groups = httpx.get(server.url + "/health").json()["groups"]
    assert [(g["state"], g["ranks"]) for g in groups] == [("ready", 2), ("ready", 2)]
    assert len(set(server.rank_pids())) == 4 and all("pids" not in g for g in groups)


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_openai_client_makes_videos_on_both_groups(server):
    client = openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0)
    jobs = [client.videos.create(model="tiny-wan", prompt=f"waves on a beach {i}", seconds="1", size="64x64")
            for i in range(4)]
    assert all(j.status in ("queued", "in_progress") and j.object == "video" for j in jobs)
    ends = time.monotonic() + 240
    done = []
    for job in jobs:
        while (job := client.videos.retrieve(job.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < ends
            time.sleep(0.3)
        done.append(job)
    assert [j.status for j in done] == ["completed"] * 4, [j.error for j in done]
    assert {j.model_extra["streamfusion"]["group"] for j in done} == {0, 1}
    assert done[0].seconds == "1" and done[0].size == "64x64" and done[0].progress == 100
    frames = iio.imread(io.BytesIO(client.videos.download_content(done[0].id).read()), index=None, extension=".mp4")
    assert frames.shape[:3] == (9, 64, 64)  # 8 frames a second + 1
    run = done[0].model_extra["streamfusion"]["runs"][0]
    assert run["frames"] == 9 and run["world_size"] == 2


def test_video_requests_are_checked(server):
    with httpx.Client(base_url=server.url) as http:
        bad = http.post("/v1/videos", json={"prompt": "a", "num_frames": 10})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_frames" and "4k + 1" in bad.text
        files = {"prompt": (None, "a"), "input_reference": ("a.png", b"\x89PNG", "image/png")}
        assert http.post("/v1/videos", files=files).json()["error"]["param"] == "input_reference"
        assert http.post("/v1/videos", json={"prompt": "a", "seconds": "x"}).json()["error"]["param"] == "seconds"
        assert http.post("/v1/images/generations", json={"prompt": "a"}).json()["error"]["code"] == "wrong_endpoint"
        assert http.get("/v1/videos/video_nope").status_code == 404


def test_a_first_frame_as_input_reference_makes_the_video_start_from_it(server):
    """Wan 2.2 TI2V's image-to-video: the multipart form's input_reference file is the video's first frame (its
    latents the first latent frame's), so the same seed gives another video."""
    still = io.BytesIO()
    Image.new("RGB", (64, 64), (250, 250, 250)).save(still, format="PNG")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        videos = []
        for reference in (still.getvalue(), None):
            files = {"prompt": (None, "waves"), "num_frames": (None, "9"), "seed": (None, "3"),
                     **({"input_reference": ("still.png", reference, "image/png")} if reference else {})}
            job = http.post("/v1/videos", files=files).json()
            ends = time.monotonic() + 120
            while (job := http.get(f"/v1/videos/{job['id']}").json())["status"] in ("queued", "in_progress"):
                assert time.monotonic() < ends
                time.sleep(0.3)
            assert job["status"] == "completed", job
            content = http.get(f"/v1/videos/{job['id']}/content").content
            videos.append(iio.imread(io.BytesIO(content), index=None, extension=".mp4"))
    first, plain = videos
    assert first.shape == plain.shape == (9, 64, 64, 3)
    assert not np.array_equal(first[0], plain[0])  # the same seed: the still made the difference (random weights
    # decode no likeness of it)


def test_the_page_makes_a_video_in_a_real_browser(server):
    with browser_page() as page:
        page.goto(server.url + "/")
        assert page.is_visible("#frames") and not page.is_visible("#key")
        page.fill("#seed", "2")
        page.click("#generate")
        page.wait_for_selector("video#result", timeout=120_000)
        status = page.text_content("#status")
    assert "done in" in status and "seed 2" in status


def test_health_is_200_while_one_of_two_groups_restarts(server):
    """A rank of group 0 killed while idle: the group restarts (said per group) and the server still serves on
    group 1 meanwhile; then both are ready again."""
    os.kill(server.rank_pids()[0], signal.SIGKILL)
    ends = time.monotonic() + 30
    while True:
        health = httpx.get(server.url + "/health")
        states = [g["state"] for g in health.json()["groups"]]
        if "restarting" in states:
            break
        assert time.monotonic() < ends, f"the killed rank went unseen: {states}"
        time.sleep(0.05)
    assert health.status_code == 200 and health.json()["status"] == "ready", health.json()
    assert sorted(states) == ["ready", "restarting"]
    ends = time.monotonic() + 120
    while [g["state"] for g in httpx.get(server.url + "/health").json()["groups"]] != ["ready", "ready"]:
        assert time.monotonic() < ends, "the killed group did not come back"
        time.sleep(0.3)
    assert "group 0" in server.stderr and "restarting it" in server.stderr

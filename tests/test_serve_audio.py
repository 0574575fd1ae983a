"""`streamfusion serve --model tiny-ltx2`: a video job of a model that makes sound answers the mp4 with its sound
track muxed in, and the sound itself as WAV through the content route's variant=audio."""
from __future__ import annotations

import io
import time
import wave

import httpx
import imageio.v3 as iio
import pytest

from serve_cases import Server

pytest.importorskip("imageio_ffmpeg")  # serving video needs the mp4 encoder


@pytest.fixture(scope="module")
def server():
    with Server("--model", "tiny-ltx2") as s:
        yield s


def test_a_video_job_serves_its_sound_muxed_and_as_wav(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        job = http.post("/v1/videos", json={"prompt": "waves on a beach", "seconds": "1", "seed": 2}).json()
        ends = time.monotonic() + 120
        while (job := http.get(f"/v1/videos/{job['id']}").json())["status"] in ("queued", "in_progress"):
            assert time.monotonic() < ends
            time.sleep(0.3)
        assert job["status"] == "completed" and job["seconds"] == "1", job
        assert http.get(f"/v1/videos/{job['id']}/content?variant=thumbnail").json()["error"]["param"] == "variant"
        video = http.get(f"/v1/videos/{job['id']}/content")
        sound = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "audio"})
    assert video.headers["content-type"] == "video/mp4" and sound.headers["content-type"] == "audio/wav"
    assert iio.imread(io.BytesIO(video.content), index=None, extension=".mp4").shape[:3] == (25, 64, 64)  # 24 fps
    assert b"mp4a" in video.content  # the sample entry of its AAC sound track
    with wave.open(io.BytesIO(sound.content)) as read:
        rate, channels, samples = read.getframerate(), read.getnchannels(), read.getnframes()
    assert (rate, channels) == (24000, 2) and abs(samples / rate - 25 / 24) < 1 / 24, samples

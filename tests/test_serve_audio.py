"""`streamfusion serve --model tiny-ltx2` and `tiny-minimax-h3`: a video job of a model that makes sound answers the
mp4 with its sound track muxed in, and the sound itself as WAV through the content route's variant=audio, as long
as the frames its `seconds` became last."""
from __future__ import annotations

import io
import time
import wave

import httpx
import imageio.v3 as iio
import pytest

from serve_cases import Server

pytest.importorskip("imageio_ffmpeg")  # serving video needs the mp4 encoder


# model: (seconds asked, the frames they become at 24 fps, the sound's sample rate); MiniMax-H3 makes 17k + 5
# frames of 5 to 15 s
CASES = {"tiny-ltx2": ("1", 25, 24000), "tiny-minimax-h3": ("5", 124, 32000)}


@pytest.fixture(scope="module", params=list(CASES))
def served(request):
    with Server("--model", request.param) as s:
        yield request.param, s


def test_a_video_job_serves_its_sound_muxed_and_as_wav(served):
    model, server = served
    seconds, frames, rate = CASES[model]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        job = http.post("/v1/videos", json={"prompt": "waves on a beach", "seconds": seconds, "seed": 2,
                                            "num_inference_steps": 2}).json()
        ends = time.monotonic() + 120
        while (job := http.get(f"/v1/videos/{job['id']}").json())["status"] in ("queued", "in_progress"):
            assert time.monotonic() < ends
            time.sleep(0.3)
        assert job["status"] == "completed" and job["seconds"] == seconds, job
        assert http.get(f"/v1/videos/{job['id']}/content?variant=thumbnail").json()["error"]["param"] == "variant"
        video = http.get(f"/v1/videos/{job['id']}/content")
        sound = http.get(f"/v1/videos/{job['id']}/content", params={"variant": "audio"})
    assert video.headers["content-type"] == "video/mp4" and sound.headers["content-type"] == "audio/wav"
    assert iio.imread(io.BytesIO(video.content), index=None, extension=".mp4").shape[:3] == (frames, 64, 64)
    assert b"mp4a" in video.content  # the sample entry of its AAC sound track
    with wave.open(io.BytesIO(sound.content)) as read:
        said = read.getframerate(), read.getnchannels(), read.getnframes()
    assert said[:2] == (rate, 2) and abs(said[2] / rate - frames / 24) < 1 / 24, said

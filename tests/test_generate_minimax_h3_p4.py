"""`streamfusion generate --model tiny-minimax-h3`: MiniMax-H3's modular blocks behind the pipeline call the runtime
makes on 4 ranks, writing video.mp4 with its stereo sound muxed in and audio.wav beside it, its video decoded on
one rank; its frame rule (17n + 5), its clip lengths (5 to 15 s) and its lack of guidance checked before any process
starts; the real-size path that encodes the prompt first gives the video and sound the whole pipeline gives; the
real-size spec counted on the meta device."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import wave
from pathlib import Path

import pytest
import torch

from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.models.build import build_pipeline
from streamfusion_diffusers.models.configs import MODELS
from streamfusion_diffusers.models.full import encode_first
from streamfusion_diffusers.models.memory import pipeline_parts
from streamfusion_diffusers.models.pipelines import family_of
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_writes_the_video_its_sound_and_run_json(pool, tmp_path):
    """124 frames at 24 fps and the audio VAE's 32 kHz stereo: audio.wav lasts the frames' 124 / 24 s within a frame,
    video.mp4 holds it as its AAC sound track, run.json says what was written."""
    import imageio.v3 as iio
    import imageio_ffmpeg

    job = generate.make_job(_args("--model", "tiny-minimax-h3", "--steps", "2", "--width", "96", "--machines", "1",
                                  "--gpus-per-machine", str(WORLD), "--output", str(tmp_path)))
    answers = pool.run(worker.generate, job)
    run = generate.write_outputs(job, answers[0])
    assert json.loads((tmp_path / "run.json").read_text()) == run and run["world_size"] == WORLD
    assert run["output_size"] == {"height": 64, "width": 96, "frames": 124} and len(run["step_latency_s"]) == 2
    assert run["vae_decode"] == "one-rank", run  # its ViT decoder: models/pipelines/minimax_h3.py says why
    assert [Path(p).name for p in run["outputs"]] == ["video.mp4", "audio.wav"], run["outputs"]
    with wave.open(str(tmp_path / "audio.wav")) as sound:
        rate, channels, samples = sound.getframerate(), sound.getnchannels(), sound.getnframes()
    assert (rate, channels) == (32000, 2) and abs(samples / rate - 124 / 24) < 1 / 24, samples
    assert run["audio"] == {"sample_rate": rate, "channels": 2, "seconds": samples / rate, "muxed": True}
    assert iio.imread(tmp_path / "video.mp4", index=None, extension=".mp4").shape[:3] == (124, 64, 96)
    said = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(tmp_path / "video.mp4")],
                          capture_output=True, text=True).stderr
    assert re.findall(r"Stream #\S+: (\w+): (\w+)", said) == [("Video", "h264"), ("Audio", "aac")], said


@pytest.mark.parametrize(("argv", "message"), [
    (("--frames", "125"), "--frames 125: must be 17k \\+ 5 \\(e.g. 124\\)$"),
    (("--frames", "107"), "--frames 107: must be from 124 to 345 \\(5 to 15 s at 24 fps\\)$"),
    (("--frames", "362"), "--frames 362: must be from 124 to 345 \\(5 to 15 s at 24 fps\\)$"),
    (("--height", "48"), "--height 48: must be a multiple of 32"),
    (("--guidance-scale", "4"), "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --guidance-scale$"),
    (("--true-cfg-scale", "4"), "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --true-cfg-scale$"),
    (("--cfg-parallel",), "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --cfg-parallel$"),
])
def test_generate_refuses_what_the_pipeline_would_round_or_refuse(argv, message):
    """Frames its VAE would round, a clip shorter or longer than diffusers' blocks make, a guidance option of a
    guidance-distilled model, the CFG split without guidance branches: one line each before any process starts."""
    with pytest.raises(ValueError, match=message):
        generate.make_job(_args("--model", "tiny-minimax-h3", *argv))


def test_encoding_first_gives_the_same_video_and_sound():
    """The real-size path (the Qwen3-VL freed before the transformer is built), on the tiny model: the same video
    and sound as the pipeline holding both."""
    pipe, encoded = encode_first("tiny-minimax-h3", "a red cat", 1024, dtype=torch.float32)
    assert pipe.text_encoder is None and pipe.transformer.device.type == "cpu"
    call = dict(height=64, width=64, num_inference_steps=2, output_type="pt")
    got = pipe(**encoded, generator=torch.Generator().manual_seed(0), **call)
    want = build_pipeline("tiny-minimax-h3")(prompt="a red cat", generator=torch.Generator().manual_seed(0), **call)
    assert got.frames.shape == (1, 124, 3, 64, 64) and got.audio.shape == (1, 2, 207 * 800)
    assert torch.equal(got.frames, want.frames) and torch.equal(got.audio, want.audio)


def test_real_size_is_minimax_h3s():
    """On the meta device: the 33B transformer and 27B Qwen3-VL that cannot share one GPU (so the prompt is
    encoded first), and the 16:9 canvas MiniMax-H3 makes without a keyframe."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    parts = pipeline_parts("minimax-h3")
    billions = {name: round(parts[name].total / 2 / 1e9, 1) for name in ("transformer", "text_encoder")}
    assert billions == {"transformer": 33.1, "text_encoder": 27.0}, billions
    assert family_of("minimax-h3").encode_first
    spec = MODELS["minimax-h3"]
    assert (spec.height, spec.width) == resolve_canvas_size(16, 9, 32, 768, 768 * 1344)
    assert spec.image_tokens(spec.height, spec.width, spec.frames) == 37 * 24 * 42  # 5n + 2 latent frames

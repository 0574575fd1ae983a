"""`streamfusion generate --model` for the newer pipelines on 4 gloo processes: tiny Wan 2.2 (TI2V-style and
A14B-style two experts), Qwen-Image, Flux.2, Z-Image and HunyuanVideo 1.5 each write their image or frames and a
run.json that says what ran (size, layout, CFG split, the VAE decode in bands); LTX-2 and MiniMax-H3 write their
sound beside their frames, as long as they last, and muxed into the mp4; options a model's pipeline does not take
(MiniMax-H3's frames its VAE would round, clips outside 5 to 15 s, guidance of a guidance-distilled model) fail
before any process starts; Flux.2's encode-first path gives the image the whole pipeline gives; the offline
tokenizers answer the calls the pipelines make."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from streamfusion_diffusers.commands import generate
from streamfusion_diffusers.runtime import worker
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.models.build import build_pipeline
from streamfusion_diffusers.models.full import encode_first

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("model", "video", "cfg"), [("tiny-wan", True, "2"), ("tiny-wan-a14b", True, "1"),
                                                     ("tiny-qwen-image", False, "2"), ("tiny-flux2", False, "1"),
                                                     ("tiny-z-image", False, "1"),
                                                     ("tiny-hunyuanvideo-1.5", True, "1")])
def test_generate_a_new_model_writes_its_output_and_run_json(pool, tmp_path, model, video, cfg):
    guidance = ("--true-cfg-scale", "4") if model == "tiny-qwen-image" else ()
    job = generate.make_job(_args("--model", model, "--steps", "2", "--height", "64", "--width", "96",
                                  "--cfg-parallel", cfg, *guidance, "--output", str(tmp_path)))
    answers = pool.run(worker.generate, job)
    records = [generate.write_outputs(job, answers[0]), *answers[1:]]
    assert records[1:] == [None] * (WORLD - 1)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run == records[0] and run["model"] == model and run["world_size"] == WORLD
    assert run["cfg"] == int(cfg) and len(run["step_latency_s"]) == 2 and not run["encoded_first"]
    assert run["vae_decode"] == "patch-parallel", run  # each one's VAE bands (tests/test_vae_parallel_p3.py)
    size = {"height": 64, "width": 96, **({"frames": 9} if video else {})}
    assert run["output_size"] == size and run["frames"] == (9 if video else None), run
    outputs = [Path(p) for p in run["outputs"]]
    assert all(p.is_file() and p.stat().st_size > 0 for p in outputs)
    assert [p.name for p in outputs][:1] == (["video.mp4"] if len(outputs) == 1 else ["000.png"]) if video else \
        ["image.png"]


SOUNDS = {  # model: its frames at 24 fps, (height, width), the sound's rate, how its VAE decodes
    "tiny-ltx2": (25, (64, 64), 24000, "patch-parallel", ()),  # its video VAE's bands (tests/test_vae_parallel_p3.py)
    "tiny-minimax-h3": (124, (64, 96), 32000, "one-rank", ("--width", "96")),  # its ViT decoder: one rank
    # (models/pipelines/minimax_h3.py says why)
}


@pytest.mark.parametrize("model", SOUNDS)
def test_a_model_with_sound_writes_it_beside_the_frames_as_long_as_they_last(pool, tmp_path, model):
    """The vocoder's (LTX-2) or the audio VAE's (MiniMax-H3) stereo: audio.wav lasts the frames' seconds at 24 fps
    within a frame (LTX-2's pipeline rounds the sound's latents to 25 a second), and video.mp4 holds it as its AAC
    sound track where imageio-ffmpeg is installed; run.json says what was written."""
    frames, (height, width), rate_made, decode, argv = SOUNDS[model]
    job = generate.make_job(_args("--model", model, "--steps", "2", *argv, "--output", str(tmp_path)))
    answers = pool.run(worker.generate, job)
    run = generate.write_outputs(job, answers[0])
    assert run["world_size"] == WORLD and answers[1:] == [None] * (WORLD - 1)
    assert run["output_size"] == {"height": height, "width": width, "frames": frames}, run
    assert len(run["step_latency_s"]) == 2 and run["vae_decode"] == decode, run
    muxed = importlib.util.find_spec("imageio_ffmpeg") is not None
    names = [Path(p).name for p in run["outputs"]]
    assert names == ["video.mp4", "audio.wav"] if muxed else names[0] == "000.png" and names[-1] == "audio.wav", names
    with wave.open(str(tmp_path / "audio.wav")) as sound:
        rate, channels, samples = sound.getframerate(), sound.getnchannels(), sound.getnframes()
    assert (rate, channels) == (rate_made, 2) and abs(samples / rate - frames / 24) < 1 / 24, samples
    assert run["audio"] == {"sample_rate": rate, "channels": 2, "seconds": samples / rate, "muxed": muxed}
    assert json.loads((tmp_path / "run.json").read_text()) == run
    if muxed:
        import imageio.v3 as iio
        import imageio_ffmpeg

        assert iio.imread(tmp_path / "video.mp4", index=None, extension=".mp4").shape[:3] == (frames, height, width)
        said = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(tmp_path / "video.mp4")],
                              capture_output=True, text=True).stderr
        assert re.findall(r"Stream #\S+: (\w+): (\w+)", said) == [("Video", "h264"), ("Audio", "aac")], said


@pytest.mark.parametrize(("argv", "message"), [
    (("--model", "tiny-qwen-image", "--frames", "9"), "--frames is for video models"),
    (("--model", "tiny-qwen-image", "--guidance-scale", "4"), "use --true-cfg-scale"),
    (("--model", "tiny-wan", "--true-cfg-scale", "4"), "drop --true-cfg-scale"),
    (("--model", "tiny-flux2", "--cfg-parallel"), "Flux.2 has none"),
    (("--model", "tiny-wan", "--height", "48"), "--height 48: must be a multiple of 32"),
    (("--model", "tiny-wan", "--frames", "8"), "must be 4k \\+ 1"),
    (("--model", "tiny-qwen-image-edit",), "--image PATH: tiny-qwen-image-edit edits an input image"),
    (("--model", "tiny-qwen-image", "--image", "x.png"), "takes no input images.*tiny-qwen-image-edit"),
    (("--model", "tiny-flux-kontext", "--image", "missing.png"), "--image missing.png: No such file"),
    (("--model", "tiny-wan", "--image", "a.png", "--image", "b.png"), "takes 1 input image, got 2"),
    (("--model", "tiny-minimax-h3", "--frames", "125"), "--frames 125: must be 17k \\+ 5 \\(e.g. 124\\)$"),
    (("--model", "tiny-minimax-h3", "--frames", "107"),
     "--frames 107: must be from 124 to 345 \\(5 to 15 s at 24 fps\\)$"),
    (("--model", "tiny-minimax-h3", "--frames", "362"),
     "--frames 362: must be from 124 to 345 \\(5 to 15 s at 24 fps\\)$"),
    (("--model", "tiny-minimax-h3", "--height", "48"), "--height 48: must be a multiple of 32"),
    (("--model", "tiny-minimax-h3", "--guidance-scale", "4"),
     "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --guidance-scale$"),
    (("--model", "tiny-minimax-h3", "--true-cfg-scale", "4"),
     "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --true-cfg-scale$"),
    (("--model", "tiny-minimax-h3", "--cfg-parallel"),
     "tiny-minimax-h3 takes no guidance \\(guidance-distilled\\): drop --cfg-parallel$"),
    pytest.param(("--model", "qwen-image"), "no GPU is visible.*--model tiny-qwen-image",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where no GPU is visible")),
])
def test_generate_refuses_what_the_model_does_not_take(argv, message):
    with pytest.raises(ValueError, match=message):
        generate.make_job(_args(*argv))


def test_generate_refuses_a_flux2_reference_under_64_pixels_before_any_rank(tmp_path):
    from PIL import Image

    small = tmp_path / "small.png"
    Image.new("RGB", (48, 96)).save(small)
    with pytest.raises(ValueError, match=f"--image {small}: 48x96 pixels: Flux.2 takes input images of at least 64"):
        generate.make_job(_args("--model", "tiny-flux2", "--image", str(small)))


def test_encoding_first_gives_the_same_image():
    """Flux.2-dev's real-size path (its encoder freed before the transformer is built), on tiny Flux.2: the same
    image as the pipeline holding both."""
    pipe, encoded = encode_first("tiny-flux2", "a red cat", 16, dtype=torch.float32)
    assert pipe.text_encoder is None and pipe.transformer.device.type == "cpu"
    call = dict(height=64, width=64, num_inference_steps=2, output_type="np")
    got = pipe(**encoded, generator=torch.Generator().manual_seed(0), **call).images
    want = build_pipeline("tiny-flux2")(prompt="a red cat", max_sequence_length=16,
                                        generator=torch.Generator().manual_seed(0), **call).images
    assert np.array_equal(got, want)


def test_offline_tokenizers_answer_the_pipelines_calls():
    """Qwen-Image drops its chat template's system prefix by count: exactly the prefix goes; Flux.2 formats a
    batch of conversations through `apply_chat_template`, padded to max_sequence_length."""
    qwen = build_pipeline("tiny-qwen-image")
    ids = qwen.tokenizer(qwen.prompt_template_encode.format("a red cat")).input_ids
    kept = qwen.tokenizer.convert_ids_to_tokens(ids[qwen.prompt_template_encode_start_idx:])
    assert kept[:3] == ["a", "red", "cat"], kept
    flux2 = build_pipeline("tiny-flux2")
    embeds = flux2.encode_prompt(prompt=["a red cat", "a dog"], device=torch.device("cpu"), max_sequence_length=16)[0]
    assert embeds.shape == (2, 16, 48)

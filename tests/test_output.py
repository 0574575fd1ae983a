"""What the pixels and sound become: a pipeline's "pt" images made 8-bit on their device as its "pil" output makes
them (diffusers' numpy path on the CPU), pixel for pixel; a model's sound as 16-bit WAV beside the mp4 and muxed
into it."""
from __future__ import annotations

import re
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamfusion_diffusers.runtime import output
from streamfusion_diffusers.runtime.output import to_pil


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_pil_makes_the_pipelines_pil_images(dtype):
    from diffusers.image_processor import VaeImageProcessor

    decoded = torch.rand(3, 3, 40, 56, generator=torch.Generator().manual_seed(0)) * 2.2 - 1.1  # past [-1, 1] too
    decoded[0, :, 0, :8] = (torch.arange(8) + 0.5) / 255 * 2 - 1  # x 255 lands on a half: rounded to even
    decoded = decoded.to(dtype)
    processor = VaeImageProcessor()
    made = to_pil(processor.postprocess(decoded, output_type="pt"))
    expected = processor.postprocess(decoded, output_type="pil")
    assert [m.mode for m in made] == [e.mode for e in expected] == ["RGB"] * 3
    for m, e in zip(made, expected):
        assert np.array_equal(np.asarray(m), np.asarray(e))


def _streams(mp4: Path) -> list[str]:
    """The kinds of an mp4's streams, as ffmpeg names them (Video, Audio)."""
    import imageio_ffmpeg

    said = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(mp4)], capture_output=True,
                          text=True).stderr
    return re.findall(r"Stream #\S+: (\w+):", said)


def test_a_sound_is_written_beside_the_video_as_wav_and_muxed_into_the_mp4(tmp_path):
    pytest.importorskip("imageio_ffmpeg")
    frames = [Image.fromarray(np.full((32, 32, 3), 30 * i, np.uint8)) for i in range(9)]
    t = np.arange(9 * 24000 // 24) / 24000
    waveform = np.stack([np.sin(2 * np.pi * 440 * t), -np.sin(2 * np.pi * 440 * t)]) * 0.5
    paths = output.write(frames, True, str(tmp_path), fps=24, audio=output.wav(waveform, 24000))
    assert [Path(p).name for p in paths] == ["video.mp4", "audio.wav"]
    with wave.open(paths[1]) as sound:
        assert (sound.getframerate(), sound.getnchannels(), sound.getsampwidth()) == (24000, 2, 2)
        pcm = np.frombuffer(sound.readframes(sound.getnframes()), "<i2").reshape(-1, 2).T
    assert np.abs(pcm / 32767 - waveform).max() <= 0.5 / 32767 + 1e-9  # 16-bit, rounded
    assert output.sound(Path(paths[1]).read_bytes()) == {"sample_rate": 24000, "channels": 2, "seconds": 9 / 24}
    assert _streams(Path(paths[0])) == ["Video", "Audio"]
    assert _streams(Path(output.write(frames, True, str(tmp_path / "silent"), fps=24)[0])) == ["Video"]

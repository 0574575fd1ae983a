"""What a generation's pixels and sound become: PNG or mp4 bytes (what `serve` answers) and files (what `generate`
writes), encoded off the ranks, so a group's GPUs go on to the next request while its last result is encoded. A
model that makes sound (LTX-2) gives WAV bytes beside its frames (`wav`, made on rank 0: a copy to 16-bit PCM),
written as audio.wav and muxed into the mp4 as its sound track."""
from __future__ import annotations

import importlib.util
import io
import logging
import os
import subprocess
import tempfile
import wave
from pathlib import Path
from typing import Any

import numpy as np

from ..core.extras import install_hint
from ..models.configs import FPS

logger = logging.getLogger(__name__)


def to_pil(images: Any) -> list:
    """A pipeline's output_type "pt" images ((B, C, H, W) in [0, 1]) as 8-bit PIL images, exactly as its "pil"
    output: x 255 in float32, rounded half to even. Made on the images' device: diffusers makes them with numpy
    on the CPU, in one thread of a rank, a tenth of a second and more per megapixel, on the way of every answer."""
    import torch
    from PIL import Image

    pixels = (images.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image) for image in pixels]


IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # OpenAI's output_format -> PIL's
PNG = ("png", 100)  # (format, quality): what an answer's images are unless a request asks otherwise


def png(image: Any) -> bytes:
    """A PIL image as PNG bytes (what `generate`'s image.png holds)."""
    return image_bytes(image)


def image_bytes(image: Any, fmt: str = "png", quality: int = 100) -> bytes:
    """A PIL image in one of IMAGE_FORMATS; `quality` (0-100, OpenAI's output_compression) for the lossy two, JPEG's
    colour kept at full resolution (4:4:4: halved, a generated image's fine colour detail blurs). PNG of a 1024 x
    1024 image takes a tenth of a second or more (its filters, on noisy images most), JPEG far less."""
    buffer = io.BytesIO()
    lossy = {} if fmt == "png" else {"quality": quality, **({"subsampling": 0} if fmt == "jpeg" else {})}
    image.save(buffer, format=IMAGE_FORMATS[fmt], **lossy)
    return buffer.getvalue()


def wav(waveform: np.ndarray, rate: int) -> bytes:
    """A waveform (channels x samples, or samples; floats in [-1, 1], clipped) as 16-bit PCM WAV bytes at `rate`
    samples a second: the stdlib's writer, so sound needs no dependency."""
    samples = np.clip(np.atleast_2d(np.asarray(waveform, dtype=np.float32)), -1.0, 1.0)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(samples.shape[0])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.round(samples.T * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def sound(audio: bytes) -> dict[str, Any]:
    """What WAV bytes hold: sample rate, channels and seconds (run.json's "audio")."""
    with wave.open(io.BytesIO(audio)) as read:
        rate = read.getframerate()
        return {"sample_rate": rate, "channels": read.getnchannels(), "seconds": read.getnframes() / rate}


def mp4(frames: list, fps: int = FPS, audio: bytes | None = None) -> bytes:
    """PIL frames as mp4 bytes at `fps` frames a second (what `generate`'s video.mp4 holds); `audio` (WAV bytes)
    muxed in as its AAC sound track by imageio-ffmpeg's ffmpeg, the video stream copied as it was encoded."""
    from diffusers.utils import export_to_video

    with tempfile.TemporaryDirectory() as folder:
        path = export_to_video(frames, os.path.join(folder, "video.mp4"), fps=fps)
        if audio is not None:
            path = _muxed(folder, path, audio)
        return Path(path).read_bytes()


def _muxed(folder: str, video: str, audio: bytes) -> str:
    """The mp4 at `video` with `audio` as its sound track, written beside it in `folder`."""
    import imageio_ffmpeg

    sound_path, muxed = os.path.join(folder, "audio.wav"), os.path.join(folder, "muxed.mp4")
    Path(sound_path).write_bytes(audio)
    done = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-i", video, "-i", sound_path,
                           "-map", "0:v", "-map", "1:a", "-c:v", "copy", "-c:a", "aac", muxed],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ffmpeg could not mux the sound into the mp4: {done.stderr.strip()[-300:]}")
    return muxed


def encode(pixels: Any, video: bool, fmt: str = "png", quality: int = 100, fps: int = FPS,
           audio: bytes | None = None) -> bytes:
    """One generation's pixels (a PIL image, or a video's PIL frames) as the bytes `serve` answers: an image in
    `fmt` (image_bytes), a video as mp4 at `fps`, its `audio` (WAV bytes) muxed in."""
    return mp4(pixels, fps, audio) if video else image_bytes(pixels, fmt, quality)


def write(pixels: Any, video: bool, folder: str, fps: int = FPS, audio: bytes | None = None) -> list[str]:
    """One generation's pixels as files in `folder`: image.png, else video.mp4 at `fps` (PNG frames without an
    encoder); its `audio` (WAV bytes) as audio.wav beside them, muxed into video.mp4 too."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not video:
        path = out / "image.png"
        pixels.save(path)
        return [str(path)]
    sounds: list[Path] = []
    if audio is not None:
        sounds.append(out / "audio.wav")
        sounds[0].write_bytes(audio)
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        path = out / "video.mp4"
        path.write_bytes(mp4(pixels, fps, audio))
        return [str(p) for p in (path, *sounds)]
    logger.warning("no video encoder installed: writing the frames as PNGs (for video.mp4: %s)",
                   install_hint("diffusers"))
    (out / "frames").mkdir(exist_ok=True)
    paths = [out / "frames" / f"{i:03d}.png" for i in range(len(pixels))]
    for frame, path in zip(pixels, paths):
        frame.save(path)
    return [str(p) for p in (*paths, *sounds)]


__all__ = ["IMAGE_FORMATS", "PNG", "encode", "image_bytes", "mp4", "png", "sound", "to_pil", "wav", "write"]

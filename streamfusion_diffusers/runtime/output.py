"""What a generation's pixels become: PNG or mp4 bytes (what `serve` answers) and files (what `generate` writes),
encoded off the ranks, so a group's GPUs go on to the next request while its last result is encoded."""
from __future__ import annotations

import importlib.util
import io
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..core.extras import install_hint

logger = logging.getLogger(__name__)

FPS = 8  # frames per second of every mp4 written or served: `seconds` s of video is FPS x seconds + 1 frames


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


def mp4(frames: list) -> bytes:
    """PIL frames as mp4 bytes (what `generate`'s video.mp4 holds)."""
    from diffusers.utils import export_to_video

    with tempfile.TemporaryDirectory() as folder:
        path = export_to_video(frames, os.path.join(folder, "video.mp4"), fps=FPS)
        return Path(path).read_bytes()


def encode(pixels: Any, video: bool, fmt: str = "png", quality: int = 100) -> bytes:
    """One generation's pixels (a PIL image, or a video's PIL frames) as the bytes `serve` answers: an image in
    `fmt` (image_bytes), a video as mp4."""
    return mp4(pixels) if video else image_bytes(pixels, fmt, quality)


def write(pixels: Any, video: bool, folder: str) -> list[str]:
    """One generation's pixels as files in `folder`: image.png, else video.mp4 (PNG frames without an encoder)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not video:
        path = out / "image.png"
        pixels.save(path)
        return [str(path)]
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        path = out / "video.mp4"
        path.write_bytes(mp4(pixels))
        return [str(path)]
    logger.warning("no video encoder installed: writing the frames as PNGs (for video.mp4: %s)",
                   install_hint("diffusers"))
    (out / "frames").mkdir(exist_ok=True)
    paths = [out / "frames" / f"{i:03d}.png" for i in range(len(pixels))]
    for frame, path in zip(pixels, paths):
        frame.save(path)
    return [str(p) for p in paths]


__all__ = ["FPS", "IMAGE_FORMATS", "PNG", "encode", "image_bytes", "mp4", "png", "to_pil", "write"]

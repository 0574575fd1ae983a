"""Input images of a request (an edit's, Flux.2's references, Wan TI2V's first frame): kept as the bytes of
their files, so that a request stays small to send to the ranks and two requests compare equal exactly when
their images do; decoded to RGB only where the pipeline is called."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

MAX_BYTES = 50 * 2**20  # OpenAI's limit on an edit's image file
MAX_PIXELS = 4096 * 4096  # more is no photo the pipelines resize to about 1024 x 1024 anyway
MODES = ("RGB", "RGBA", "L", "LA", "P", "I;16", "I", "CMYK", "YCbCr")  # what converts to RGB as a photo


def check(data: bytes, name: str, family: Any = None) -> tuple[int, int]:
    """The image's (width, height); a ValueError naming `name` where it is no image, too large, of a mode that is
    no picture (a float or multi-band scientific image), or of a size `family`'s pipeline refuses."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_BYTES:
        raise ValueError(f"{name}: the file is {len(data) / 2**20:.1f} MiB, more than {MAX_BYTES // 2**20} MiB")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:
            size, mode = image.size, image.mode
    except UnidentifiedImageError:  # (its message shows the buffer's repr, which says nothing)
        raise ValueError(f"{name}: not an image PIL can read (PNG, JPEG, WebP, ...)") from None
    except (OSError, SyntaxError, ValueError) as err:  # a known format, damaged: PIL says where
        raise ValueError(f"{name}: not an image PIL can read (PNG, JPEG, WebP, ...): {err}") from None
    if size[0] * size[1] > MAX_PIXELS:
        raise ValueError(f"{name}: {size[0]}x{size[1]} pixels, more than {MAX_PIXELS} in all; downscale it")
    if mode not in MODES:
        raise ValueError(f"{name}: image mode {mode} is not a picture; give an RGB, RGBA or grayscale image")
    if family is not None and (why := family.image_refusal(*size)):
        raise ValueError(f"{name}: {why}")
    return size


def read(path: str, name: str = "--image", family: Any = None) -> bytes:
    """An image file's bytes, checked (`check`, for `family`'s pipeline); a ValueError naming the path where it
    cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{name} {path}: {err.strerror or err}") from None
    check(data, f"{name} {path}", family)
    return data


def decode(data: bytes) -> Any:
    """The image as the pipelines take it: a PIL image in RGB."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def blank(width: int, height: int) -> bytes:
    """A mid-gray PNG: the input image of a warm-up edit."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


__all__ = ["MAX_BYTES", "MAX_PIXELS", "blank", "check", "decode", "read"]

"""A streamed image request's answer: server-sent events shaped as OpenAI's image streaming.

OpenAI's events are `<kind>.partial_image` (a preview: `b64_json`, `partial_image_index` from 0) and
`<kind>.completed` (the image), the kind being `image_generation` (POST /v1/images/generations) or `image_edit`
(POST /v1/images/edits). Ours add `<kind>.progress` at every step's end (`step` of `steps`, `elapsed_s` since the
pipeline call began), which OpenAI's clients pass through as an event of that type; a failure after the stream
began is an `error` event in OpenAI's error shape (its clients raise on it).
"""
from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from PIL import Image

from ..runtime.output import image_bytes
from ..runtime.progress import StepNote
from .errors import ApiError

MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy holds the events back


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: its type, and its JSON data (which repeats the type, as OpenAI's do)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def image_fields(size: str, fmt: str) -> dict[str, Any]:
    """The fields every image event of OpenAI's carries, as this server makes images."""
    return {"created_at": int(time.time()), "size": size, "output_format": fmt, "background": "opaque",
            "quality": "auto"}


async def image_events(kind: str, notes: AsyncIterator[StepNote], request_id: str, size: str, finish: Any,
                       image_format: tuple[str, int]) -> AsyncIterator[bytes]:
    """Progress and previews of `request_id` as its steps end, then `finish()`'s completed event (the request's
    answer), each named `kind.<event>`, the images in `image_format`; an ApiError on the way ends the stream with
    an error event."""
    previews = 0
    try:
        async for note in notes:
            yield sse(f"{kind}.progress", {"step": note.step, "steps": note.steps,
                                                    "elapsed_s": round(note.elapsed_s, 4)})
            if (pixels := note.previews.get(request_id)) is not None:
                b64 = base64.b64encode(image_bytes(Image.fromarray(pixels), *image_format)).decode()
                yield sse(f"{kind}.partial_image", {**image_fields(size, image_format[0]), "b64_json": b64,
                                                    "partial_image_index": previews})
                previews += 1
        yield sse(f"{kind}.completed", {**image_fields(size, image_format[0]), **finish()})
    except ApiError as err:
        yield f"event: error\ndata: {json.dumps(err.body())}\n\n".encode()


__all__ = ["HEADERS", "MEDIA_TYPE", "image_events", "sse"]

"""Every field of a request, checked on the front before anything reaches the ranks.

A request becomes `Request` (what the ranks run) or an `ApiError` whose message names the field and the allowed
range; nothing in a request names a file path or code, and fields the endpoint does not take are refused (as
OpenAI refuses them), so a typo never silently falls back to a default. Sizes must be the model's multiple
(the pipeline would round others silently) and give at least one token per rank.
"""
from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any
from urllib.parse import parse_qsl

from ..runtime.job import Job
from ..runtime.output import FPS
from ..runtime.request import Request
from ..models.pipelines import FAMILIES
from .errors import ApiError, bad

SIZE = re.compile(r"(\d{1,6})x(\d{1,6})")
MAX_SEED = 2**63 - 1
IMAGE_FIELDS = ("model", "prompt", "n", "size", "response_format", "output_format", "user", "negative_prompt",
                "seed", "num_inference_steps", "guidance_scale")
VIDEO_FIELDS = ("model", "prompt", "seconds", "size", "num_frames", "negative_prompt", "seed",
                "num_inference_steps", "guidance_scale")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (`serve`'s --max-* options)."""

    max_n: int
    max_steps: int
    max_pixels: int
    max_frames: int
    max_prompt_chars: int


def parse_json(body: bytes) -> dict[str, Any]:
    """A JSON object, else 400."""
    try:
        fields = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(None, f"the body is not valid JSON ({err}): send a JSON object", "invalid_json") from None
    if not isinstance(fields, dict):
        raise bad(None, f"the body is JSON {type(fields).__name__}, not an object: send {{\"prompt\": ...}}",
                  "invalid_json")
    return fields


def parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """A multipart or urlencoded form (what OpenAI's client sends to /v1/videos) as its text fields; a file field
    (input_reference, image to video) is refused."""
    if content_type.startswith("application/x-www-form-urlencoded"):
        return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise bad(None, "the form is not multipart/form-data with a boundary: send JSON or a multipart form",
                  "invalid_form")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            continue
        if part.get_filename() is not None:
            raise bad(name, f"{name}: files are not taken (image-to-video is not served); send text fields only")
        payload = part.get_payload(decode=True) or b""
        fields[name] = payload.decode("utf-8", "replace")
    return fields


def _integer(fields: dict[str, Any], name: str, low: int, high: int, default: int, form: bool) -> int:
    value = fields.get(name)
    if value is None:
        return default
    if form and isinstance(value, str) and re.fullmatch(r"-?\d{1,20}", value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name}: must be an integer from {low} to {high}, got {json.dumps(value)[:40]}")
    if not low <= value <= high:
        raise bad(name, f"{name} {value}: must be from {low} to {high}")
    return value


def _number(fields: dict[str, Any], name: str, low: float, high: float, form: bool) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if form and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name}: must be a number from {low:g} to {high:g}, got {json.dumps(value)[:40]}")
    if not low <= value <= high:
        raise bad(name, f"{name} {value:g}: must be from {low:g} to {high:g}")
    return float(value)


def _text(fields: dict[str, Any], name: str, limit: int, required: bool) -> str | None:
    value = fields.get(name)
    if value is None:
        if required:
            raise bad(name, f"{name}: missing; send a text of 1 to {limit} characters", "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise bad(name, f"{name}: must be a string of at most {limit} characters, got {type(value).__name__}")
    if required and not value.strip():
        raise bad(name, f"{name}: empty; send a text of 1 to {limit} characters")
    if len(value) > limit:
        raise bad(name, f"{name}: {len(value)} characters, at most {limit} allowed")
    return value


class Checker:
    """The checks of one served job: its model, default size and steps, guidance, ranks and the limits."""

    def __init__(self, job: Job, limits: Limits):
        self.job, self.limits = job, limits
        self.family = FAMILIES[job.spec.family]
        # CogVideoX and Wan run two guidance branches when guidance_scale > 1: a request must keep the server's
        # count (the CFG split over the ranks is fixed when the server starts)
        self.guided = self.family.guided(job.guidance_scale, job.true_cfg_scale)

    def _common(self, fields: dict[str, Any], allowed: tuple[str, ...], form: bool) -> dict[str, Any]:
        unknown = sorted(set(fields) - set(allowed))
        if unknown:
            raise bad(unknown[0], f"unknown field {unknown[0]!r}: this endpoint takes {', '.join(allowed)}",
                      "unknown_parameter")
        model = fields.get("model")
        if model is not None and model != self.job.model:
            raise ApiError(404, f"model {str(model)[:80]!r} is not served here: this server runs {self.job.model} "
                                f"(GET /v1/models)", param="model", code="model_not_found")
        limits = self.limits
        size = fields.get("size")
        height, width = self.job.height, self.job.width
        if size not in (None, "auto"):
            found = SIZE.fullmatch(size) if isinstance(size, str) else None
            if found is None:
                raise bad("size", f"size: must be \"WIDTHxHEIGHT\" in pixels (e.g. \"{self.job.width}x"
                                  f"{self.job.height}\") or \"auto\", got {json.dumps(size)[:40]}")
            width, height = int(found[1]), int(found[2])
        step = self.job.spec.size_step
        if width <= 0 or height <= 0 or width % step or height % step:
            raise bad("size", f"size {width}x{height}: width and height must be positive multiples of {step} for "
                              f"{self.job.model} (e.g. {max(step, width // step * step)}x"
                              f"{max(step, height // step * step)})")
        if width * height > limits.max_pixels:
            raise bad("size", f"size {width}x{height}: {width * height} pixels, at most {limits.max_pixels} "
                              f"(--max-pixels) allowed")
        steps = _integer(fields, "num_inference_steps", 1, limits.max_steps, self.job.steps, form)
        seed = _integer(fields, "seed", 0, MAX_SEED, -1, form)
        if seed < 0:  # none given: a fresh one, said in the answer so the image can be made again
            seed = secrets.randbelow(2**31)
        negative = _text(fields, "negative_prompt", limits.max_prompt_chars, required=False)
        if negative is not None and not self.guided:
            raise bad("negative_prompt", f"negative_prompt: {self.job.model} runs here without classifier-free "
                                         f"guidance; start the server with guidance (--true-cfg-scale > 1 for "
                                         f"Flux.1 and Qwen-Image, --guidance-scale > 1 for CogVideoX and Wan)")
        guidance = _number(fields, "guidance_scale", 0.0, 100.0, form)
        if guidance is not None:
            if self.job.guidance_scale is None:
                raise bad("guidance_scale", f"guidance_scale: {self.job.model} has none (it guides by true CFG)")
            if self.family.cfg_by == "guidance_scale" and (guidance > 1) != self.guided:
                allowed = "above 1" if self.guided else "from 0 to 1"
                raise bad("guidance_scale", f"guidance_scale {guidance:g}: must be {allowed} on this server (its "
                                            f"two-branch guidance is fixed at start: --guidance-scale)")
        return {"prompt": _text(fields, "prompt", limits.max_prompt_chars, required=True),
                "negative_prompt": negative, "height": height, "width": width, "steps": steps, "seed": seed,
                "guidance_scale": self.job.guidance_scale if guidance is None else guidance}

    def _tokens(self, height: int, width: int, frames: int) -> None:
        tokens = self.job.spec.image_tokens(height, width, frames)
        if tokens < self.job.world_size:
            raise bad("size", f"size {width}x{height}: {tokens} image tokens, fewer than the {self.job.world_size} "
                              f"ranks of a parallel group; ask for a larger size")

    def image(self, fields: dict[str, Any]) -> Request:
        """POST /v1/images/generations."""
        if self.job.spec.video:
            raise bad("model", f"{self.job.model} makes videos: POST /v1/videos", "wrong_endpoint")
        common = self._common(fields, IMAGE_FIELDS, form=False)
        response_format = fields.get("response_format", "b64_json")
        if response_format != "b64_json":
            raise bad("response_format", f"response_format {json.dumps(response_format)[:40]}: only \"b64_json\" "
                                         f"is served (no image is stored behind a url)")
        if fields.get("output_format", "png") != "png":
            raise bad("output_format", "output_format: only \"png\" is served (lossless, as generate writes it)")
        _text(fields, "user", 256, required=False)
        n = _integer(fields, "n", 1, self.limits.max_n, 1, form=False)
        self._tokens(common["height"], common["width"], 1)
        return Request(**common, frames=1, n=n)

    def video(self, fields: dict[str, Any], form: bool) -> Request:
        """POST /v1/videos: `seconds` (FPS x seconds + 1 frames) or `num_frames` (the model's 4k + 1)."""
        if not self.job.spec.video:
            raise bad("model", f"{self.job.model} makes images: POST /v1/images/generations", "wrong_endpoint")
        common = self._common(fields, VIDEO_FIELDS, form)
        ratio, limit = self.job.spec.temporal, self.limits.max_frames
        if fields.get("seconds") is not None and fields.get("num_frames") is not None:
            raise bad("seconds", "seconds and num_frames both given: send one")
        frames = self.job.frames
        if fields.get("seconds") is not None:
            seconds = _integer({"seconds": fields["seconds"]}, "seconds", 1, (limit - 1) // FPS, 0,
                               form=isinstance(fields["seconds"], str))
            frames = FPS * seconds + 1
        frames = _integer(fields, "num_frames", 1, limit, frames, form)
        if (frames - 1) % ratio:
            raise bad("num_frames", f"num_frames {frames}: must be {ratio}k + 1 (e.g. {(frames - 1) // ratio * ratio + 1})")
        self._tokens(common["height"], common["width"], frames)
        return Request(**common, frames=frames)


__all__ = ["Checker", "Limits", "Request", "parse_form", "parse_json"]

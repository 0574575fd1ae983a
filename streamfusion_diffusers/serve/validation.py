"""Every request checked on the front before anything reaches the ranks, against the served job and its limits.

The shapes and types are protocol.py's pydantic models; here a validated request becomes `Request` (what the ranks
run) or an `ApiError` whose message names the field and the allowed range, and pydantic's own refusals are
turned into the same messages (`Checker.refusal`). Nothing in a request names a file path or code. Sizes must be
the model's multiple (the pipeline would round others silently) and give at least one token per rank.
"""
from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Sequence
from typing import Any

from ..runtime.job import Job
from ..runtime.progress import PREVIEW_FAMILIES
from ..runtime.request import Request
from ..models.pipelines import adapter
from .errors import ApiError, bad
from .limits import SIZE, Limits
from ..runtime import images as input_images
from .protocol import EditRequest, ImageRequest, LoraChoice, VideoRequest

MAX_LORA_SCALE = 10.0  # a LoRA's weight, either sign: far past the 0..1.5 LoRAs are made for
MAX_SEED = 2**63 - 1
JSON_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "list": "an array",
              "dict": "an object", "NoneType": "null"}


def _typed(value: Any) -> str:
    return JSON_NAMES.get(type(value).__name__, type(value).__name__)


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _within(name: str, value: float | None, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise bad(name, f"{name} {_number(value)}: must be from {_number(low)} to {_number(high)}")


class Checker:
    """The checks of one served job: its model, default size and steps, guidance, ranks and the limits."""

    def __init__(self, job: Job, limits: Limits):
        self.job, self.limits = job, limits
        self.family = adapter(job.spec.family)
        # CogVideoX and Wan run two guidance branches when guidance_scale > 1: a request must keep the server's
        # count (the CFG split over the ranks is fixed when the server starts)
        self.guided = self.family.guided(job.guidance_scale, job.true_cfg_scale)
        # each numeric field's range, in its type error and its range error alike
        self.ranges: dict[str, tuple[float, float]] = {
            "n": (1, limits.max_n), "num_inference_steps": (1, limits.max_steps), "seed": (0, MAX_SEED),
            "guidance_scale": (0, 100), "num_frames": (1, limits.max_frames),
            "seconds": job.spec.seconds_range(limits.max_frames), "output_compression": (0, 100),
            "partial_images": (0, 3)}

    def refusal(self, errors: Sequence[dict[str, Any]], fields: tuple[str, ...]) -> ApiError:
        """pydantic's first error (FastAPI's RequestValidationError, or a form's) as a 400 naming the field and the
        allowed type and range; `fields` are the route's (said when an unknown one is sent)."""
        error = errors[0]
        kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
        where = [str(part) for part in error["loc"] if part != "body"]
        if kind == "json_invalid":
            return bad(None, f"the body is not valid JSON ({ctx.get('error', 'malformed')}): send a JSON object",
                       "invalid_json")
        if not where or where[0].isdigit():  # the body as a whole
            if kind == "missing":
                return bad(None, "the body is empty: send a JSON object such as {\"prompt\": \"a red cat\"}",
                           "invalid_json")
            return bad(None, f"the body is JSON {_typed(value).split()[-1]}, not an object: send {{\"prompt\": ...}}",
                       "invalid_json")
        name = where[0]
        if kind == "extra_forbidden":
            return bad(name, f"unknown field {name!r}: this endpoint takes {', '.join(fields)}", "unknown_parameter")
        if kind == "missing":
            return bad(name, f"{name}: missing; send a text of 1 to {self.limits.max_prompt_chars} characters",
                       "missing_required_parameter")
        low, high = self.ranges.get(name, (None, None))
        span = f" from {_number(low)} to {_number(high)}" if low is not None else ""
        if name == "size":
            span = f" \"WIDTHxHEIGHT\" in pixels (e.g. \"{self.job.width}x{self.job.height}\") or \"auto\""
        wanted = {"string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
                  "int_parsing": "an integer", "float_type": "a number", "float_parsing": "a number",
                  "finite_number": "a finite number", "bool_type": "true or false", "bool_parsing": "true or false"}
        if kind in wanted:
            shown = json.dumps(value)[:40] if isinstance(value, (str, int, float, bool)) else _typed(value)
            return bad(name, f"{name}: must be {wanted[kind]}{span}, got {shown}")
        if kind == "literal_error":
            return bad(name, f"{name} {json.dumps(value)[:40]}: must be one of {ctx['expected']}")
        if kind == "value_error":  # a field's own validator (protocol.py), whose message names the field
            return bad(name, str(ctx.get("error", error["msg"])))
        if kind == "string_too_long":
            return bad(name, f"{name}: {len(value)} characters, at most {ctx['max_length']} allowed")
        return bad(name, f"{name}: {error['msg']}")

    def _text(self, name: str, value: str | None, required: bool) -> None:
        limit = self.limits.max_prompt_chars
        if required and value is not None and not value.strip():
            raise bad(name, f"{name}: empty; send a text of 1 to {limit} characters")
        if value is not None and len(value) > limit:
            raise bad(name, f"{name}: {len(value)} characters, at most {limit} allowed")

    def _common(self, request: ImageRequest | VideoRequest) -> dict[str, Any]:
        if request.model is not None and request.model != self.job.model:
            raise ApiError(404, f"model {request.model[:80]!r} is not served here: this server runs {self.job.model} "
                                f"(GET /v1/models)", param="model", code="model_not_found")
        limits = self.limits
        height, width = self.job.height, self.job.width
        if request.size not in (None, "auto"):
            found = SIZE.fullmatch(request.size)
            if found is None:
                raise bad("size", f"size: must be \"WIDTHxHEIGHT\" in pixels (e.g. \"{self.job.width}x"
                                  f"{self.job.height}\") or \"auto\", got {json.dumps(request.size)[:40]}")
            width, height = int(found[1]), int(found[2])
        step = self.job.spec.size_step
        if width <= 0 or height <= 0 or width % step or height % step:
            raise bad("size", f"size {width}x{height}: width and height must be positive multiples of {step} for "
                              f"{self.job.model} (e.g. {max(step, width // step * step)}x"
                              f"{max(step, height // step * step)})")
        if width * height > limits.max_pixels:
            raise bad("size", f"size {width}x{height}: {width * height} pixels, at most {limits.max_pixels} "
                              f"(--max-pixels) allowed")
        for name in ("num_inference_steps", "seed", "guidance_scale"):
            _within(name, getattr(request, name), *self.ranges[name])
        cache, steps = self.job.stack.cache, request.num_inference_steps
        if cache is not None and cache.name == "magcache" and steps is not None and steps != cache.steps:
            raise bad("num_inference_steps", f"num_inference_steps {steps}: --cache magcache runs here at "
                                             f"{cache.steps} steps only (its magnitude ratios are set to the steps "
                                             f"when the pipeline is built); ask for {cache.steps}, or start a server "
                                             f"with --steps {steps}")
        self._text("prompt", request.prompt, required=True)
        self._text("negative_prompt", request.negative_prompt, required=False)
        if request.negative_prompt is not None and not self.guided:
            raise bad("negative_prompt", f"negative_prompt: {self.job.model} runs here without classifier-free "
                                         f"guidance; start the server with guidance (--true-cfg-scale > 1 for "
                                         f"Flux.1 and Qwen-Image, --guidance-scale > 1 for CogVideoX and Wan)")
        guidance = request.guidance_scale
        if guidance is not None:
            if self.job.guidance_scale is None:
                guides = "it guides by true CFG" if self.family.cfg_by == "true_cfg_scale" else "guidance-distilled"
                raise bad("guidance_scale", f"guidance_scale: {self.job.model} has none ({guides}); drop the field")
            if self.family.cfg_by == "guidance_scale" and (guidance > 1) != self.guided:
                allowed = "above 1" if self.guided else "from 0 to 1"
                raise bad("guidance_scale", f"guidance_scale {guidance:g}: must be {allowed} on this server (its "
                                            f"two-branch guidance is fixed at start: --guidance-scale)")
        # no seed given: a fresh one, said in the answer so the image can be made again
        seed = secrets.randbelow(2**31) if request.seed is None else request.seed
        return {"prompt": request.prompt, "negative_prompt": request.negative_prompt, "height": height,
                "width": width, "steps": request.num_inference_steps or self.job.steps, "seed": seed,
                "guidance_scale": self.job.guidance_scale if guidance is None else guidance,
                "lora": self._lora(request.lora)}

    def _lora(self, choices: list[LoraChoice] | None) -> tuple[tuple[str, float], ...]:
        """The named adapters a request picks, each with its weight (its own, else the one serve gave it)."""
        known = {lora.name: lora.scale for lora in self.job.stack.adapters}
        picked: dict[str, float] = {}
        for choice in choices or ():
            if choice.name not in known:
                have = (f"this server has {', '.join(sorted(map(repr, known)))}" if known else
                        "this server has none (start it with --lora NAME=PATH)")
                raise bad("lora", f"lora {choice.name[:64]!r}: no such LoRA; {have}", "unknown_lora")
            if choice.name in picked:
                raise bad("lora", f"lora {choice.name!r}: named twice; name each LoRA once")
            scale = known[choice.name] if choice.scale is None else choice.scale
            if abs(scale) > MAX_LORA_SCALE:
                raise bad("lora", f"lora {choice.name!r} scale {scale:g}: must be from {-MAX_LORA_SCALE:g} to "
                                  f"{MAX_LORA_SCALE:g}")
            picked[choice.name] = scale
        return tuple(picked.items())

    def _tokens(self, height: int, width: int, frames: int) -> None:
        tokens = self.job.spec.image_tokens(height, width, frames)
        if tokens < self.job.world_size:
            raise bad("size", f"size {width}x{height}: {tokens} image tokens, fewer than the {self.job.world_size} "
                              f"ranks of a parallel group; ask for a larger size")

    def image(self, request: ImageRequest) -> Request:
        """POST /v1/images/generations."""
        if self.family.needs_image:
            raise bad("model", f"{self.job.model} edits an input image: POST /v1/images/edits", "wrong_endpoint")
        return self._image(request)

    def edit(self, request: EditRequest, files: dict[str, list[bytes]]) -> Request:
        """POST /v1/images/edits: `files` are the form's files by field name (`image[]` as `image`)."""
        spec = self.job.spec
        if files.get("mask"):
            raise bad("mask", f"mask: {self.job.model} edits the whole image as the prompt says and takes no mask; "
                              f"send the image and the prompt only")
        unknown = sorted(set(files) - {"image", "mask"})
        if unknown:
            raise bad(unknown[0], f"{unknown[0]}: not a file field of this route; send image (one or several) only")
        given = files.get("image", [])
        if not given:
            raise bad("image", "image: missing; send the image to edit as a file (multipart field image)")
        if spec.images == 0:
            raise bad("image", f"image: {self.job.model} takes no input image; start the server with an edit model "
                               f"(qwen-image-edit, flux-kontext) or one that takes references (flux2-dev)")
        if len(given) > spec.images:
            raise bad("image", f"image: {len(given)} images sent, {self.job.model} takes at most {spec.images}")
        for index, data in enumerate(given):
            try:
                input_images.check(data, "image" if len(given) == 1 else f"image[{index}]", self.family)
            except ValueError as err:
                raise bad("image", str(err)) from None
        return dataclasses.replace(self._image(request), images=tuple(given))

    def _image(self, request: ImageRequest) -> Request:
        if self.job.spec.video:
            raise bad("model", f"{self.job.model} makes videos: POST /v1/videos", "wrong_endpoint")
        common = self._common(request)
        if request.response_format == "url":
            raise bad("response_format", "response_format \"url\": only \"b64_json\" is served (no image is stored "
                                         "behind a url)")
        if request.background == "transparent":
            raise bad("background", "background \"transparent\": images are opaque here; send \"opaque\" or \"auto\"")
        for name in ("n", "output_compression", "partial_images"):
            _within(name, getattr(request, name), *self.ranges[name])
        partial = (request.partial_images or 0) if request.stream else 0
        if request.stream and (request.n or 1) > 1:
            raise bad("n", f"n {request.n} with stream true: a stream carries one image; send n 1, or stream false")
        if partial and self.family.name not in PREVIEW_FAMILIES:
            raise bad("partial_images", f"partial_images {partial}: {self.job.model}'s latents are not previewed "
                                        f"(only {', '.join(PREVIEW_FAMILIES)} models'); send 0 for step progress only")
        self._tokens(common["height"], common["width"], 1)
        return Request(**common, frames=1, n=request.n or 1, partial_images=partial)

    def video(self, request: VideoRequest) -> Request:
        """POST /v1/videos: `seconds` (the fewest frames the model makes that last them) or `num_frames` (the
        model's 4k + 1, or its video VAE's own rule), within the clip lengths its pipeline makes."""
        if not self.job.spec.video:
            raise bad("model", f"{self.job.model} makes images: POST /v1/images/generations", "wrong_endpoint")
        reference = request.input_reference
        if reference is not None and not self.job.spec.images:
            raise bad("input_reference", f"input_reference: {self.job.model} makes videos from text only; send text "
                                         f"fields only (Wan 2.2 TI2V takes a first frame)")
        if reference is not None and not isinstance(reference, bytes):
            raise bad("input_reference", "input_reference: send the first frame as a file (multipart)")
        if reference is not None:
            try:
                input_images.check(reference, "input_reference", self.family)
            except ValueError as err:
                raise bad("input_reference", str(err)) from None
        common = self._common(request)
        if request.seconds is not None and request.num_frames is not None:
            raise bad("seconds", "seconds and num_frames both given: send one")
        frames = self.job.frames
        if request.seconds is not None:
            _within("seconds", request.seconds, *self.ranges["seconds"])
            frames = self.job.spec.frames_for(request.seconds)
        elif request.num_frames is not None:
            _within("num_frames", request.num_frames, *self.ranges["num_frames"])
            frames = request.num_frames
        refusal = self.job.spec.frames_refusal(frames)
        if refusal:
            raise bad("num_frames", f"num_frames {frames}: {refusal}")
        self._tokens(common["height"], common["width"], frames)
        return Request(**common, frames=frames, images=() if reference is None else (reference,))


__all__ = ["Checker", "Limits"]

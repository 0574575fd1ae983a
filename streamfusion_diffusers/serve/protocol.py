"""OpenAI's request and response shapes for the routes served, as pydantic models.

Requests are strict (JSON types as OpenAI documents them: "2" is not an integer) and forbid fields the route does
not take, so a typo is refused rather than silently falling back to a default. Every field OpenAI documents for a
route is accepted by name; `Checker` (validation.py) then checks the values against the server's limits, and
`ImageRequest.ignored` says which of them change nothing here. Ranges that depend on the server's options
(`--max-n`, `--max-steps`, ...) are checked there too, so one message names the type and the range.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


def _seconds_text(value: Any) -> Any:
    """OpenAI sends a video's `seconds` as a string ("4"); a whole number in it is taken as that integer."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


class LoraChoice(BaseModel):
    """One named LoRA a request runs (`serve --lora NAME=PATH`), at `scale` (default: the one serve gave it)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    name: str = Field(min_length=1, max_length=64)
    scale: float | None = None


LORA_FORMS = 'a LoRA name, "name:scale", or a list of them or of {"name": ..., "scale": ...}'


def _lora_choices(value: Any) -> Any:
    """`lora` as a list of LoraChoice: a name, "name:scale", or a list of those or of {"name", "scale"} objects."""
    if value is None or isinstance(value, list) and not value:
        return None
    items = value if isinstance(value, list) else [value]
    choices = []
    for item in items:
        if isinstance(item, str):
            name, colon, text = item.rpartition(":") if ":" in item else (item, "", "")
            try:
                scale = float(text) if colon else None
            except ValueError:
                raise ValueError(f"lora {item!r}: the scale {text!r} is not a number; send {LORA_FORMS}") from None
            item = {"name": name, "scale": scale}
        if not isinstance(item, (dict, LoraChoice)):
            raise ValueError(f"lora: {type(item).__name__} is none of {LORA_FORMS}")
        try:
            choices.append(item if isinstance(item, LoraChoice) else LoraChoice.model_validate(item))
        except ValidationError as err:  # said as the request's own field, not a nested model's
            found = err.errors()[0]
            where = ".".join(str(part) for part in found["loc"])
            raise ValueError(f"lora {json.dumps(item)[:80]}: {where}: {found['msg'].lower()}; send "
                             f"{LORA_FORMS}") from None
    return choices


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str
    model: str | None = None
    size: str | None = None
    # streamfusion's own fields (OpenAI's clients send them through extra_body)
    negative_prompt: str | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    lora: Annotated[list[LoraChoice] | None, BeforeValidator(_lora_choices)] = None


class ImageRequest(_Request):
    """POST /v1/images/generations."""

    n: int | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = None
    quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = None
    style: Literal["vivid", "natural"] | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    moderation: Literal["auto", "low"] | None = None
    stream: bool | None = None
    partial_images: int | None = None
    user: str | None = Field(default=None, max_length=256)

    def ignored(self) -> dict[str, str]:
        """OpenAI's fields given that change nothing here, each with why (the answer's `streamfusion.ignored`)."""
        why = {"quality": "the quality follows num_inference_steps and the model here",
               "style": "the model has no style switch: say it in the prompt",
               "moderation": "no moderation is run here",
               "user": "kept by no one here",
               "output_compression": "PNG is lossless (it applies to jpeg and webp)",
               "partial_images": "previews come only with stream true",
               "background": "images are opaque"}
        used = {"partial_images": bool(self.stream), "output_compression": self.output_format in ("jpeg", "webp")}
        return {name: f"{getattr(self, name)!r}: {text}" for name, text in why.items()
                if name in self.model_fields_set and not used.get(name)}

    @property
    def image_format(self) -> tuple[str, int]:
        """How the answer's images are encoded: output_format (png unless given) and output_compression, the
        quality a lossy format keeps (100 unless given, as OpenAI's default)."""
        return self.output_format or "png", 100 if self.output_compression is None else self.output_compression


class EditRequest(ImageRequest):
    """POST /v1/images/edits: OpenAI's multipart form's text fields (validated with `strict=False`, its fields
    being text); the image files (`image`, `image[]`, `mask`) are read beside it."""

    input_fidelity: Literal["high", "low"] | None = None

    def ignored(self) -> dict[str, str]:
        said = super().ignored()
        if "input_fidelity" in self.model_fields_set:
            said["input_fidelity"] = f"{self.input_fidelity!r}: the model keeps what it keeps of the input image"
        return said


class VideoRequest(_Request):
    """POST /v1/videos (JSON, or OpenAI's multipart form: validated with `strict=False`, its fields being text)."""

    seconds: Annotated[int | None, BeforeValidator(_seconds_text)] = None
    num_frames: int | None = None
    input_reference: Any = None  # image to video: refused by the checker with why


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    """OpenAI's answer, with what ran in `streamfusion` (the record generate writes to run.json, and more)."""

    created: int
    data: list[ImageData]
    size: str
    output_format: Literal["png", "jpeg", "webp"] = "png"
    streamfusion: dict[str, Any]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "streamfusion"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx answer: what OpenAI's clients turn into BadRequestError, RateLimitError, ..."""

    error: ErrorDetail


__all__ = ["EditRequest", "ErrorDetail", "ErrorResponse", "ImageData", "ImageRequest", "ImagesResponse", "LoraChoice",
           "ModelCard", "ModelList", "VideoRequest"]

"""OpenAI's request and response shapes for the routes served, as pydantic models.

Requests are strict (JSON types as OpenAI documents them: "2" is not an integer) and forbid fields the route does
not take, so a typo is refused rather than silently falling back to a default. Every field OpenAI documents for a
route is accepted by name; `Checker` (validation.py) then checks the values against the server's limits, and
`ImageRequest.ignored` says which of them change nothing here. Ranges that depend on the server's options
(`--max-n`, `--max-steps`, ...) are checked there too, so one message names the type and the range.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _seconds_text(value: Any) -> Any:
    """OpenAI sends a video's `seconds` as a string ("4"); a whole number in it is taken as that integer."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


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
               "output_compression": "PNG is lossless",
               "partial_images": "images are not streamed",
               "background": "images are opaque"}
        return {name: f"{getattr(self, name)!r}: {text}" for name, text in why.items()
                if name in self.model_fields_set}


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
    output_format: Literal["png"] = "png"
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


__all__ = ["EditRequest", "ErrorDetail", "ErrorResponse", "ImageData", "ImageRequest", "ImagesResponse", "ModelCard", "ModelList",
           "VideoRequest"]

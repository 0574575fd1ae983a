"""The image routes: OpenAI's /v1/images/generations (JSON, streamed as server-sent events when asked) and
/v1/images/edits (a multipart form with the image files). Each request is checked against the served job
(validation.py), queued and waited for through the service, and answered in OpenAI's shape with what ran.
"""
from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from ..runtime.request import Request as Generation
from .events import HEADERS, MEDIA_TYPE, image_events
from .protocol import EditRequest, ImageData, ImageRequest, ImagesResponse
from .service import Service, what_ran

MAX_EDIT_FILES = 17  # an edit's images (Flux.2 takes up to 10) and a mask, with room to say which is too many


def image_routes(service: Service) -> APIRouter:
    """The routes that make and edit images on `service`."""
    router = APIRouter()

    async def answer(kind: str, body: ImageRequest, params: Generation,
                     request: Request) -> ImagesResponse | StreamingResponse:
        """Run a checked image request (`kind`: OpenAI's event prefix, image_generation or image_edit) and answer
        it: JSON, or its steps as server-sent events when it asked to stream."""
        request.state.did = (f"size={params.size} steps={params.steps} n={params.n}" +
                             (f" images={len(params.images)}" if params.images else "") + " stream" * bool(body.stream))
        work = await service.submit("image", params, streamed=bool(body.stream), image_format=body.image_format)

        def ran(result: dict[str, Any]) -> dict[str, Any]:
            extra = what_ran(work, result)
            if ignored := body.ignored():
                extra["ignored"] = ignored
            return extra

        if body.stream:  # the queue's refusals (429, 503) came above, as JSON; the rest come as events
            def completed() -> dict[str, Any]:
                result = work.done.result()
                return {"b64_json": base64.b64encode(result["outputs"][0]).decode(), "streamfusion": ran(result)}

            notes = service.stream(work, request.is_disconnected)
            return StreamingResponse(image_events(kind, notes, params.id, params.size, completed, body.image_format),
                                     media_type=MEDIA_TYPE, headers=HEADERS)
        result = await service.wait(work, request.is_disconnected)
        data = [ImageData(b64_json=base64.b64encode(image).decode()) for image in result["outputs"]]
        return ImagesResponse(created=int(time.time()), size=params.size, output_format=body.image_format[0],
                              streamfusion=ran(result), data=data)

    @router.post("/v1/images/generations", response_model=None)
    async def images(body: ImageRequest, request: Request) -> ImagesResponse | StreamingResponse:
        service.taking()
        await service.planned()
        return await answer("image_generation", body, service.checker.image(body), request)

    @router.post("/v1/images/edits", response_model=None)
    async def edits(request: Request) -> ImagesResponse | StreamingResponse:
        """OpenAI's multipart form: the image file(s) as `image` (or `image[]`, as OpenAI's client sends several),
        an optional `mask`, and the text fields of EditRequest, read by python-multipart through Starlette's form
        parser (as /v1/videos: a field not taken is refused, which FastAPI's `Form()` parameters would drop); a body
        of another type was refused by the V1 gate (edge.py)."""
        service.taking()
        await service.planned()
        files: dict[str, list[bytes]] = {}
        fields: dict[str, str] = {}
        async with request.form(max_files=MAX_EDIT_FILES, max_fields=32) as form:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    files.setdefault(name.removesuffix("[]"), []).append(await value.read())
                else:
                    fields[name] = value
        try:
            body = EditRequest.model_validate(fields, strict=False)
        except ValidationError as err:
            raise service.checker.refusal(err.errors(), tuple(EditRequest.model_fields)) from None
        return await answer("image_edit", body, service.checker.edit(body, files), request)

    return router


__all__ = ["image_routes"]

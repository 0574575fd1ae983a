"""The HTTP routes (FastAPI): OpenAI's images and videos API, /v1/models, /health, /metrics and the page at `/`.

Bodies are read and checked here (size cap, JSON or form, every field: validation.py) before anything is queued;
every refusal has OpenAI's error shape. With an API key every /v1 route needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import base64
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from importlib.resources import files
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException

from .errors import ApiError
from .service import Service, what_ran
from ..runtime.output import FPS
from .validation import parse_form, parse_json

logger = logging.getLogger(__name__)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by its Content-Length, or as it arrives)."""
    too_big = ApiError(413, f"the body is larger than {limit} bytes (--max-body-bytes)", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    return bytes(body)


class Guard:
    """Every request: the API key on /v1 routes, then its status and latency into the metrics. Plain ASGI (not
    Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from the route that waits)."""

    def __init__(self, app: Any, service: Service, api_key: str | None):
        self.app, self.service = app, service
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        if self.expected is not None and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                                 code="invalid_api_key")
                self.service.metrics.request("/v1 (unauthorized)", 401, time.monotonic() - started)
                response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        status = 500

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.service.metrics.request(route, status, time.monotonic() - started)


def make_app(service: Service, api_key: str | None, max_body_bytes: int) -> FastAPI:
    """The app over a started-or-starting service (the lifespan starts it and closes it)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="streamfusion serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    app.add_middleware(Guard, service=service, api_key=api_key)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        what = "no such route" if err.status_code == 404 else str(err.detail)
        error = ApiError(err.status_code, f"{request.method} {request.url.path}: {what}", code="not_found"
                         if err.status_code == 404 else "method_not_allowed")
        return JSONResponse(error.body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception) -> JSONResponse:
        logger.exception("serve: unexpected error")
        return JSONResponse(ApiError(500, f"internal error: {type(err).__name__}: {err}").body(), status_code=500)

    def taking() -> None:
        if service.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        spec = service.job.spec
        config = {"model": service.job.model, "video": spec.video, "width": service.job.width,
                  "height": service.job.height, "steps": service.job.steps, "frames": service.job.frames,
                  "fps": FPS, "size_step": spec.size_step, "max_steps": service.checker.limits.max_steps,
                  "auth": api_key is not None}
        html = files(__package__).joinpath("page.html").read_text()
        return html.replace("__CONFIG__", json.dumps(config).replace("</", "<\\/"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(service.render_metrics(), media_type="text/plain; version=0.0.4")

    def model_object() -> dict[str, Any]:
        return {"id": service.job.model, "object": "model", "created": service.created, "owned_by": "streamfusion"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        if model != service.job.model:
            raise ApiError(404, f"model {model[:80]!r} is not served here: this server runs {service.job.model}",
                           param="model", code="model_not_found")
        return model_object()

    @app.post("/v1/images/generations")
    async def images(request: Request) -> dict[str, Any]:
        taking()
        params = service.checker.image(parse_json(await read_body(request, max_body_bytes)))
        work = await service.submit("image", params)
        result = await service.wait(work, request.is_disconnected)
        return {"created": int(time.time()),
                "data": [{"b64_json": base64.b64encode(png).decode()} for png in result["outputs"]],
                "streamfusion": what_ran(work, result)}

    @app.post("/v1/videos")
    async def create_video(request: Request) -> dict[str, Any]:
        taking()
        body = await read_body(request, max_body_bytes)
        content_type = request.headers.get("content-type", "application/json")
        form = content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded"))
        fields = parse_form(body, content_type) if form else parse_json(body)
        job = await service.submit_video(service.checker.video(fields, form))
        return job.describe()

    def video_job(video_id: str):
        job = service.videos.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id[:80]!r} here (unknown, or forgotten after --keep-videos newer "
                                f"ones)", param="video_id", code="video_not_found")
        return job

    @app.get("/v1/videos")
    async def list_videos() -> dict[str, Any]:
        data = [job.describe() for job in reversed(service.videos.jobs.values())]
        return {"object": "list", "data": data, "has_more": False}

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> dict[str, Any]:
        return video_job(video_id).describe()

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> FileResponse:
        job = video_job(video_id)
        if variant != "video":
            raise ApiError(400, f"variant {variant[:40]!r}: only \"video\" is served", param="variant")
        if job.path is None:
            raise ApiError(409, f"video {video_id} is {job.status}: GET /v1/videos/{video_id} until its status is "
                                f"completed", param="video_id", code="video_not_ready")
        return FileResponse(job.path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict[str, Any]:
        service.delete_video(video_job(video_id))  # a queued or running one is stopped first
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains the service (503 to new requests, the accepted ones
    finish, then exit 0) instead of stopping at once; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals, which uvicorn raises again after its shutdown (exit -15, not 0)
        if self.service.draining or self.service.loop is None:
            self.should_exit = True
            return
        loop = self.service.loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self.service.drain()))


__all__ = ["DrainingServer", "make_app", "read_body"]

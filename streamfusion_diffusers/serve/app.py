"""The HTTP app (FastAPI): the layers in front (edge.py), the routes by resource (image_routes.py, video_routes.py)
and here the server's own: /v1/models, /health, /metrics, the page at `/`, the errors in OpenAI's shape; and the
uvicorn server whose first stop signal drains.

Bodies are validated by protocol.py's pydantic models, checked against the server's limits by validation.py; every
refusal has OpenAI's error shape.
"""
from __future__ import annotations

import json
from contextlib import asynccontextmanager
from importlib.resources import files
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from .edge import Edge, V1Gate, error_response
from .errors import ApiError
from .image_routes import image_routes
from .metrics import CONTENT_TYPE
from .protocol import EditRequest, ImageRequest, ModelCard, ModelList, VideoRequest
from .service import Service
from .video_routes import video_routes

BODIES = {"/v1/images/generations": ImageRequest, "/v1/videos": VideoRequest, "/v1/images/edits": EditRequest}


def make_app(service: Service, api_key: str | None, max_body_bytes: int, loopback: bool = True,
             allow_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app over a started-or-starting service (the lifespan starts it and closes it)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        await service.start()
        yield
        await service.close()

    app = FastAPI(title="streamfusion serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # the last added is the outermost: Edge, then CORS for the allowed origins, then V1Gate (so a 401 to an
    # allowed page carries CORS headers, and the page can read it)
    app.add_middleware(V1Gate, api_key=api_key, max_body_bytes=max_body_bytes)
    if allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allow_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)
    app.add_middleware(Edge, metrics=service.metrics, loopback=loopback, allow_origins=allow_origins)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        body = BODIES.get(request.url.path, ImageRequest)
        await service.planned()
        return error_response(service.checker.refusal(err.errors(), tuple(body.model_fields)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return error_response(ApiError(err.status_code, f"{request.method} {request.url.path}: {what}",
                                       code=codes.get(err.status_code, "invalid_request")))

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        await service.planned()
        spec = service.job.spec
        config = {"model": service.job.model, "video": spec.video, "width": service.job.width,
                  "height": service.job.height, "steps": service.job.steps, "frames": service.job.frames,
                  "fps": spec.fps, "size_step": spec.size_step, "max_steps": service.checker.limits.max_steps,
                  "auth": api_key is not None, "images": spec.images,
                  "edits_only": service.checker.family.needs_image}
        html = files(__package__).joinpath("page.html").read_text()
        return html.replace("__CONFIG__", json.dumps(config).replace("</", "<\\/"))

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.render_metrics(), media_type=CONTENT_TYPE)

    def model_card() -> ModelCard:
        return ModelCard(id=service.job.model, created=service.created)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model}")
    async def model(model: str) -> ModelCard:
        if model != service.job.model:
            raise ApiError(404, f"model {model[:80]!r} is not served here: this server runs {service.job.model}",
                           param="model", code="model_not_found")
        return model_card()

    app.include_router(image_routes(service))
    app.include_router(video_routes(service))
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


__all__ = ["DrainingServer", "make_app"]

"""The HTTP routes (FastAPI): OpenAI's images and videos API, /v1/models, /health, /metrics and the page at `/`.

Two ASGI layers stand in front of the routes. `Edge`, outermost: a request id on every answer (X-Request-Id),
one access-log line and the metrics per request, the Host check when bound to loopback (DNS rebinding), the Origin
check (a page of another site is refused unless `--allow-origin` names it; those get CORS through Starlette's
middleware), and unexpected errors answered 500 with the request id only (the traceback goes to the log under
that id). `V1Gate`, on /v1 routes: the API key, JSON only as application/json (multipart too where a route takes
a form), the body size cap. Bodies are validated by protocol.py's pydantic models, checked against the server's
limits by validation.py; every refusal has OpenAI's error shape.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from importlib.resources import files
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..runtime.output import FPS
from ..runtime.request import Request as Generation
from .errors import ApiError
from .events import HEADERS, MEDIA_TYPE, image_events
from .metrics import CONTENT_TYPE, Metrics
from .protocol import EditRequest, ImageData, ImageRequest, ImagesResponse, ModelCard, ModelList, VideoRequest
from .service import Service, what_ran

logger = logging.getLogger(__name__)
access = logging.getLogger(__name__.rsplit(".", 1)[0] + ".access")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # the Host names a server bound to loopback answers
FORM_ROUTES = ("/v1/videos", "/v1/images/edits")  # the routes that take OpenAI's multipart form
BODIES = {"/v1/images/generations": ImageRequest, "/v1/videos": VideoRequest, "/v1/images/edits": EditRequest}
MAX_EDIT_FILES = 17  # an edit's images (Flux.2 takes up to 10) and a mask, with room to say which is too many
CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's own X-Request-Id, kept when it looks like one


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={**error.headers, **(headers or {})})


def host_name(host: str) -> str:
    """The name of a Host header without its port ("[::1]:8000" -> "[::1]")."""
    host = host.strip().lower()
    return host[:host.index("]") + 1] if host.startswith("[") and "]" in host else host.split(":")[0]


class Edge:
    """Every request, outermost: its id, the Host and Origin checks, its log line and metrics, and any unexpected
    error answered 500 with the id. Plain ASGI (not Starlette's BaseHTTPMiddleware, which would hide a client's
    disconnect from the route that waits)."""

    def __init__(self, app: Any, metrics: Metrics, loopback: bool, allow_origins: tuple[str, ...]):
        self.app, self.metrics, self.loopback, self.allow_origins = app, metrics, loopback, allow_origins

    def refusal(self, headers: Headers) -> ApiError | None:
        host = headers.get("host")
        if self.loopback and host is not None and host_name(host) not in LOOPBACK_NAMES:
            return ApiError(421, f"Host {host[:80]!r}: this server listens on loopback and answers only "
                                 f"{', '.join(LOOPBACK_NAMES)} (start it with --host to serve other names)",
                            code="misdirected_request")
        origin = headers.get("origin")
        if origin is not None and origin not in self.allow_origins and urlsplit(origin).netloc != (host or "").lower():
            return ApiError(403, f"a page of {origin[:80]} may not call this server: start it with --allow-origin "
                                 f"{origin[:80]} to let pages from there call it", code="origin_not_allowed")
        return None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        headers = Headers(scope=scope)
        given = headers.get("x-request-id", "")
        request_id = given if CLIENT_ID.fullmatch(given) else f"req_{secrets.token_hex(8)}"
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status, size = 0, 0

        async def sending(message: dict) -> None:
            nonlocal status, size
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))
            await send(message)

        try:
            refused = self.refusal(headers)
            if refused is not None:
                scope["route_label"] = "refused"
                await error_response(refused)(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        except asyncio.CancelledError:  # the server stops at once (a second signal): say so in OpenAI's shape
            if not status:
                await error_response(ApiError(503, "the server stopped before the request finished",
                                              code="unavailable"))(scope, receive, sending)
            raise
        except Exception:  # noqa: BLE001 - any error of ours: the details go to the log, the client gets the id
            logger.exception("request %s failed", request_id)
            if not status:
                error = ApiError(500, f"internal error; the server log has its details under request id "
                                      f"{request_id}", code="internal_error")
                await error_response(error)(scope, receive, sending)
        finally:
            seconds = time.monotonic() - started
            route = scope.get("route_label") or getattr(scope.get("route"), "path", "other")
            self.metrics.request(route, status or 500, seconds)
            did = state.get("did")
            access.info("%s %s %s %d %.3fs %dB%s", request_id, scope["method"], scope["path"], status or 500,
                        seconds, size, f" {did}" if did else "")


class V1Gate:
    """/v1 routes: the API key (`Authorization: Bearer <key>`, the scheme in any case), the body's Content-Type
    (JSON only as application/json: a page of another site can send a form or text/plain without asking first,
    never application/json), and the body size cap (by Content-Length, or as the body arrives)."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int):
        self.app, self.key, self.limit = app, api_key, max_body_bytes

    def authorized(self, header: str) -> bool:
        scheme, _, token = header.strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.key is not None and not self.authorized(headers.get("authorization", "")):
            scope["route_label"] = "/v1 (unauthorized)"
            error = ApiError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                             code="invalid_api_key")
            return await error_response(error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            takes = ("application/json", "multipart/form-data") if scope["path"] in FORM_ROUTES else \
                ("application/json",)
            if media not in takes:
                error = ApiError(415, f"Content-Type {media or 'none'!r}: {scope['path']} takes "
                                      f"{' or '.join(takes)} (curl: -H \"Content-Type: application/json\")",
                                 code="unsupported_media_type")
                scope["route_label"] = "/v1 (refused)"
                return await error_response(error)(scope, receive, send)
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.limit:
                scope["route_label"] = "/v1 (refused)"
                return await error_response(self.too_big())(scope, receive, send)
            receive = self.capped(receive)
        await self.app(scope, receive, send)

    def too_big(self) -> ApiError:
        return ApiError(413, f"the body is larger than {self.limit} bytes (--max-body-bytes)", code="body_too_large")

    def capped(self, receive: Any) -> Any:
        """`receive` that stops a body growing past the cap (one sent without Content-Length)."""
        received = 0

        async def receiving() -> dict:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.too_big().message)  # FastAPI lets an HTTPException through as is
            return message

        return receiving


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
        return error_response(service.checker.refusal(err.errors(), tuple(body.model_fields)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        what = "no such route" if err.status_code == 404 else str(err.detail)
        return error_response(ApiError(err.status_code, f"{request.method} {request.url.path}: {what}",
                                       code=codes.get(err.status_code, "invalid_request")))

    def taking() -> None:
        if service.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", code="draining")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        spec = service.job.spec
        config = {"model": service.job.model, "video": spec.video, "width": service.job.width,
                  "height": service.job.height, "steps": service.job.steps, "frames": service.job.frames,
                  "fps": FPS, "size_step": spec.size_step, "max_steps": service.checker.limits.max_steps,
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

    async def answer(kind: str, body: ImageRequest, params: Generation,
                     request: Request) -> ImagesResponse | StreamingResponse:
        """Run a checked image request (`kind`: OpenAI's event prefix, image_generation or image_edit) and answer
        it: JSON, or its steps as server-sent events when it asked to stream."""
        request.state.did = (f"size={params.size} steps={params.steps} n={params.n}" +
                             (f" images={len(params.images)}" if params.images else "") + " stream" * bool(body.stream))
        work = await service.submit("image", params, streamed=bool(body.stream))

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
            return StreamingResponse(image_events(kind, notes, params.id, params.size, completed),
                                     media_type=MEDIA_TYPE, headers=HEADERS)
        result = await service.wait(work, request.is_disconnected)
        return ImagesResponse(created=int(time.time()), size=params.size, streamfusion=ran(result),
                              data=[ImageData(b64_json=base64.b64encode(png).decode()) for png in result["outputs"]])

    @app.post("/v1/images/generations", response_model=None)
    async def images(body: ImageRequest, request: Request) -> ImagesResponse | StreamingResponse:
        taking()
        return await answer("image_generation", body, service.checker.image(body), request)

    @app.post("/v1/images/edits", response_model=None)
    async def edits(request: Request) -> ImagesResponse | StreamingResponse:
        """OpenAI's multipart form: the image file(s) as `image` (or `image[]`, as OpenAI's client sends several),
        an optional `mask`, and the text fields of EditRequest, read by python-multipart through Starlette's form
        parser (as /v1/videos: a field not taken is refused, which FastAPI's `Form()` parameters would drop)."""
        taking()
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(415, "POST /v1/images/edits takes multipart/form-data (curl: -F image=@photo.png -F "
                                "prompt=...)", code="unsupported_media_type")
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

    @app.post("/v1/videos")
    async def create_video(request: Request) -> dict[str, Any]:
        """JSON, or OpenAI's multipart form (its client's way), read by python-multipart through Starlette's form
        parser: one route taking both cannot declare FastAPI's `Form()` parameters."""
        taking()
        try:
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                async with request.form(max_files=1, max_fields=32) as form:
                    for name, value in form.multi_items():
                        if isinstance(value, UploadFile) and name != "input_reference":
                            raise ApiError(400, f"{name}: the one file taken is input_reference (the first "
                                                f"frame); send the others as text fields", param=name,
                                           code="invalid_value")
                    fields = {name: await value.read() if isinstance(value, UploadFile) else value
                              for name, value in form.multi_items()}
                    video = VideoRequest.model_validate(fields, strict=False)
            else:
                video = VideoRequest.model_validate_json(await request.body())
        except ValidationError as err:
            raise service.checker.refusal(err.errors(), tuple(VideoRequest.model_fields)) from None
        params = service.checker.video(video)
        request.state.did = f"size={params.size} steps={params.steps} frames={params.frames}"
        job = await service.submit_video(params)
        return job.describe()

    def video_job(video_id: str):
        job = service.videos.get(video_id)
        if job is None:
            raise ApiError(404, f"no video {video_id[:80]!r} here: unknown, deleted, or forgotten (this server keeps "
                                f"{service.videos.keep.said()})", param="video_id", code="video_not_found")
        return job

    @app.get("/v1/videos")
    async def list_videos() -> dict[str, Any]:
        data = [job.describe() for job in service.videos.listing()]
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


__all__ = ["DrainingServer", "Edge", "V1Gate", "make_app"]

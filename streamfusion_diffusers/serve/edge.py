"""The two ASGI layers in front of the routes: what every request meets before a route sees it.

`Edge`, outermost: a request id on every answer (X-Request-Id), one access-log line and the metrics per request,
the Host check when bound to loopback (DNS rebinding), the Origin check (a page of another site is refused unless
`--allow-origin` names it; those get CORS through Starlette's middleware), and unexpected errors answered 500 with
the request id only (the traceback goes to the log under that id). `V1Gate`, on /v1 routes: the API key, JSON only
as application/json (multipart where a route takes a form: MEDIA_TYPES), the body size cap. Every refusal has OpenAI's
error shape.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from .errors import ApiError
from .metrics import Metrics

logger = logging.getLogger(__name__)
access = logging.getLogger(__name__.rsplit(".", 1)[0] + ".access")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")  # the Host names a server bound to loopback answers
# the body types of the /v1 routes that take OpenAI's multipart form (every other one: JSON only), the first the
# one a refusal's curl hint shows
MEDIA_TYPES = {"/v1/videos": ("application/json", "multipart/form-data"), "/v1/images/edits": ("multipart/form-data",)}
CURL_HINTS = {"application/json": "curl: -H \"Content-Type: application/json\" -d '{\"prompt\": ...}'",
              "multipart/form-data": "curl: -F image=@photo.png -F prompt=..."}
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
            takes = MEDIA_TYPES.get(scope["path"], ("application/json",))
            if media not in takes:
                error = ApiError(415, f"Content-Type {media or 'none'!r}: {scope['method']} {scope['path']} takes "
                                      f"{' or '.join(takes)} ({CURL_HINTS[takes[0]]})",
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



__all__ = ["Edge", "V1Gate", "error_response", "host_name"]

"""OpenAI's error shape: every refusal is `{"error": {"message", "type", "param", "code"}}` with an HTTP status,
so OpenAI's clients raise their usual exceptions (BadRequestError, RateLimitError, ...) with our message."""
from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request refused or failed: the status, the message that names the fix, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        from .protocol import ErrorDetail, ErrorResponse  # pydantic (extra `serve`): only a running server answers

        detail = ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 for one field: the message names the field and what it allows."""
    return ApiError(400, message, param=param, code=code)


__all__ = ["ApiError", "bad"]

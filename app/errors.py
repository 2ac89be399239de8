"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every status.

Messages never quote the client's prompt or completion text.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("mtpserve.errors")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised anywhere in the HTTP layer; rendered by :func:`error_response`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


class ClientGone(Exception):
    """The client disconnected before the response was complete (logged as status 499)."""


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


def too_many(message: str, retry_after: float, code: str = "rate_limit_exceeded") -> APIError:
    seconds = str(max(1, int(retry_after + 0.999)))
    return APIError(429, message, code=code, headers={"Retry-After": seconds})


def unavailable(message: str, code: str = "unavailable") -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": "5"})


_LOC_SKIP = {"body", "query", "path", "header", "str", "int", "float", "bool", "list", "dict"}


def validation_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages.0.role"``; union-member tags that
    pydantic puts in locations (``"list[str]"``, ``"function-after[...]"``) are dropped."""
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p not in _LOC_SKIP and "[" not in p and "-" not in p)
    ]
    return ".".join(parts) or None


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first: Any = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    # Within a union, the member that got furthest (deepest location) explains best.
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(first["loc"])[:2]]
    first = max(same_field or [first], key=lambda e: len(e.get("loc", ())))
    if first.get("type") == "json_invalid":
        return error_response(
            bad_request("The request body is not valid JSON.", code="json_invalid")
        )
    param = validation_param(tuple(first.get("loc", ())))
    # pydantic's message ("Input should be ...") never quotes the input itself.
    msg = str(first.get("msg", "invalid value"))
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return error_response(bad_request(message, param=param, code="invalid_value"))


async def _client_gone(_request: Request, _exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(499, "client closed the request", code="client_closed"), 499)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    headers = dict(exc.headers or {})
    return JSONResponse(error_body(exc.status_code, message), exc.status_code, headers=headers)


async def _unhandled(_request: Request, exc: Exception) -> JSONResponse:
    # The exception's message may quote input, so log its type and where it came from only.
    where = "".join(traceback.format_tb(exc.__traceback__)[-3:])
    log.error("unhandled error %s at\n%s", type(exc).__name__, where)
    return JSONResponse(error_body(500, "Internal server error.", code="internal_error"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(Exception, _unhandled)

"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Handlers raise `APIError` (or a helper below); `install_error_handlers` also maps FastAPI's request
validation (400, not FastAPI's 422, as OpenAI answers), unknown routes and crashes to that shape.
"""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("pellucid.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )
        self.retry_after = retry_after  # seconds; sent as Retry-After, which clients honour

    def response(self) -> JSONResponse:
        response = error_response(self.status, self.message, self.kind, self.param, self.code)
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(self.retry_after)
        return response


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; `kind` goes to its "type" field."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _crash)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
    # loc starts with where the value came from ("body"); OpenAI's `param` is the field path.
    # A union (prompt: str | list[...]) fails once per alternative: name what they share.
    if errors[0].get("type") == "json_invalid":  # its loc is a character position, not a field
        detail = errors[0].get("ctx", {}).get("error", "")
        return error_response(
            400, f"the request body is not valid JSON: {detail}", "invalid_request_error"
        )
    paths = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    param = ".".join(os.path.commonprefix(paths)) or None  # commonprefix works on any lists
    message = str(errors[0].get("msg"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return error_response(400, message, "invalid_request_error", param)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, str(exc.detail), kind)


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(
        500, f"internal server error: {type(exc).__name__}: {exc}", "server_error"
    )

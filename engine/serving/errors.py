"""OpenAI-shaped error bodies, and the handlers that turn exceptions into them."""

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvscope.engine.orchestrator.streams import EngineClosed, RequestFailed

logger = logging.getLogger(__name__)
# Engine errors start with the knob: "temperature=-1 must be >= 0", "prompt: 300 tokens...".
KNOB_PREFIX = re.compile(r"^([A-Za-z_]\w*)\s*[=:]")
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 413: "invalid_request_error",
               503: "service_unavailable", 500: "internal_error"}


class APIError(Exception):
    """An error the API answers with, in OpenAI's shape."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class FieldError(ValueError):
    """A refusal of one request field whose name need not be an identifier (extra fields
    are the client's own keys: "", "max tokens", "é"), so it carries the name itself."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def error_body(status_code: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status_code, "api_error"),
                      "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status_code, error.message, error.param, error.code),
                        status_code=error.status_code, headers=error.headers)


def from_exception(error: Exception) -> APIError:
    """The API error for an exception raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, FieldError):
        return APIError(400, str(error), param=error.param)
    if isinstance(error, ValueError):
        match = KNOB_PREFIX.match(str(error))
        return APIError(400, str(error), param=match.group(1) if match else None)
    if isinstance(error, EngineClosed):
        return APIError(503, str(error), code="shutting_down")
    if isinstance(error, RequestFailed):
        return APIError(500, str(error), code="engine_step_failed")
    logger.exception("unexpected error while serving a request", exc_info=error)
    return APIError(500, f"internal error: {type(error).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    async def handle(_: Request, error: Exception) -> JSONResponse:
        return error_response(from_exception(error))

    async def handle_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI answers 400 naming the field.
        # A body that is not JSON at all is the body's fault, not a field's (its location
        # names a character offset).
        first = error.errors()[0]
        location = [] if first.get("type") == "json_invalid" else [
            str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(location) or "body"
        return error_response(APIError(400, f"{param}: {first.get('msg')}", param=param))

    async def handle_http(_: Request, error: HTTPException) -> JSONResponse:
        # FastAPI's own 400 is a body it could not read (not UTF-8, say).
        param = "body" if error.status_code == 400 else None
        return error_response(APIError(error.status_code, str(error.detail), param=param,
                                       headers=getattr(error, "headers", None)))

    for kind in (APIError, ValueError, EngineClosed, RequestFailed):
        app.add_exception_handler(kind, handle)
    app.add_exception_handler(RequestValidationError, handle_validation)
    app.add_exception_handler(HTTPException, handle_http)

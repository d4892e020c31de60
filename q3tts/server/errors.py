"""The API's one error shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that make every
refusal (ours, FastAPI's validation, Starlette's 404/405) answer in it."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match

from ..errors import quote

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"


class APIError(Exception):
    """A refusal or failure the client should see, with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str = "not_found") -> APIError:
    return APIError(404, message, param=param, code=code)


def queue_full(retry_after_s: int) -> APIError:
    return APIError(429, "the server is at capacity (request queue full); retry later", type=RATE_LIMIT,
                    code="queue_full", headers={"Retry-After": str(retry_after_s)})


def not_ready() -> APIError:
    return APIError(503, "the model is still loading or warming up; retry when /ready answers 200", type=SERVER,
                    code="model_not_ready", headers={"Retry-After": "5"})


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance", type=SERVER, code="shutting_down",
                    headers={"Retry-After": "1"})


def engine_failed(message: str) -> APIError:
    return APIError(503, message, type=SERVER, code="engine_error")


def json_error(reason: str, where: object) -> str:
    """A JSON parser's complaint and where ("Unterminated string starting at" already ends in "at")."""
    return f"{reason} {'' if reason.endswith(' at') else 'at '}character {where}"


def from_validation(exc: Exception, model: type[BaseModel] | None = None) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 naming the offending field; an unknown top-level field
    of `model` is answered with the closest of its fields ("did you mean")."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return bad_request(str(exc))
    # An unknown field first: a misspelt one also makes the field it meant missing.
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    if first.get("type") == "json_invalid":  # (its loc is the body and a character offset, not a field)
        where = (first.get("loc") or ("?",))[-1]
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return bad_request(f"the request body is not valid JSON: {json_error(reason, where)}", code="invalid_json")
    # A location can hold what the client sent (an unknown key is its own location).
    loc = [field(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = ".".join(loc) or None
    code = {"missing": "missing", "unsupported": "unsupported"}.get(first.get("type"), "invalid_value")
    message = first.get("msg", "invalid value")
    if first.get("type") == "model_type":  # (pydantic names the class: "or instance of DialogueTurn")
        message = "Input should be a JSON object"
    if first.get("type") == "extra_forbidden":  # (pydantic's "Extra inputs are not permitted")
        message = "unknown field"
    if first.get("type") == "extra_forbidden" and len(loc) == 1 and model is not None:
        known = sorted(field_names(model))
        sent = str(first["loc"][-1])
        close = difflib.get_close_matches(sent, known, n=1, cutoff=0.6) if len(sent) <= 100 else []
        message = ("unknown field" + f"; did you mean {close[0]!r}?" if close else
                   f"unknown field; the fields are {', '.join(known)}" if len(known) <= 12 else
                   "unknown field (docs/http-api.md lists the fields each API sends)")
    return bad_request(f"{param}: {message}" if param else message, param=param, code=code)


def field_names(model: type[BaseModel]) -> set[str]:
    """The names a client may send `model`'s fields by (their aliases too)."""
    return {name for key, info in model.model_fields.items() for name in (key, info.alias) if name}


def field(part: object) -> str:
    """A field's name, which a client chose (an unknown key), as `param`: cut as every quote is."""
    text = str(part)
    return text if len(text) <= 40 else quote(text)


def install_handlers(app: FastAPI, on_error: Callable[[str | None], None] = lambda code: None) -> None:
    """Every refusal answers in the one shape; `on_error(code)` counts it."""

    def respond(error: APIError) -> JSONResponse:
        on_error(error.code)
        return error.response()

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(from_validation(exc))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        # 400: the body could not be parsed (a multipart form with no boundary, say), before any route read it.
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER
        message = routing_message(request, exc) if exc.status_code in (404, 405) else str(exc.detail)
        return respond(APIError(exc.status_code, message, type=kind, code=code, headers=exc.headers))


def routing_message(request: Request, exc: HTTPException) -> str:
    """The router's 404 and 405 ("Not Found", "Method Not Allowed") saying what was asked for: for a 405 the
    methods the path takes, for a WebSocket route asked over plain HTTP that it is one."""
    if exc.detail != HTTPStatus(exc.status_code).phrase:  # (a detail of its own: as it is)
        return str(exc.detail)
    path = request.url.path
    if exc.status_code == 405:
        return f"{quote(path, 100)} takes {(exc.headers or {}).get('Allow', 'other methods')}, not {request.method}"
    as_websocket = {**request.scope, "type": "websocket"}
    if any(route.matches(as_websocket)[0] is Match.FULL for route in request.app.routes):
        return f"{quote(path, 100)} is a WebSocket route: open it as a WebSocket (ws:// or wss://)"
    return f"no route {quote(path, 100)} (docs/server.md lists the routes)"

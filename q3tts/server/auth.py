"""Optional bearer-token auth (`--api-key`): /v1/* HTTP routes (checked by guard.py before the body is read) and
the WebSocket answer 401 without it. /health, /ready and /metrics stay open (orchestrators and scrapers call them).
A key sent in the query (`?api_key=`, the only way a browser's WebSocket can send one) is hidden in the logs."""

from __future__ import annotations

import logging
import secrets
from urllib.parse import unquote_plus

from fastapi import WebSocket

from .errors import AUTHENTICATION, APIError


def unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", type=AUTHENTICATION,
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_authorized(expected: str | None, authorization: str | None, query_key: str | None = None) -> bool:
    if not expected:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else (query_key or "")
    return secrets.compare_digest(given.encode(), expected.encode())


class HideQueryKeys(logging.Filter):
    """Hides `api_key` values, right or wrong, in the paths with query that uvicorn's request lines quote (HTTP ones
    on "uvicorn.access", WebSocket ones on "uvicorn.error")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(hide_query_key(a) if isinstance(a, str) else a for a in record.args)
        return True


def hide_query_key(path: str) -> str:
    """`path` with the value of its query's `api_key` (spelt as the server reads it, %-escapes and all) as ***."""
    head, mark, query = path.partition("?")
    if not mark:
        return path
    fields = [field.partition("=") for field in query.split("&")]
    return head + mark + "&".join(name + eq + ("***" if eq and unquote_plus(name) == "api_key" else value)
                                  for name, eq, value in fields)


async def websocket_authorized(websocket: WebSocket) -> bool:
    """Checks the header (or `?api_key=`, for browsers); refuses the handshake with the 401 error body if the
    server supports denial responses, else accepts and closes with an error event (code 1008)."""
    key = websocket.app.state.config.api_key
    if is_authorized(key, websocket.headers.get("authorization"), websocket.query_params.get("api_key")):
        return True
    error = unauthorized()
    websocket.app.state.metrics.count_error(error.code)
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error.response())
    else:
        await websocket.accept()
        await websocket.send_json({"type": "error", **error.body()})
        await websocket.close(code=1008)
    return False

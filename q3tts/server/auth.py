"""Optional bearer-token auth (`--api-key`): /v1/* HTTP routes (checked by guard.py before the body is read) and
the WebSocket answer 401 without it. /health, /ready and /metrics stay open (orchestrators and scrapers call them)."""

from __future__ import annotations

import secrets

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


async def websocket_authorized(websocket: WebSocket) -> bool:
    """Checks the header (or `?api_key=`, for browsers); refuses the handshake with the 401 error body if the
    server supports denial responses, else accepts and closes with an error event (code 1008)."""
    key = websocket.app.state.config.api_key
    if is_authorized(key, websocket.headers.get("authorization"), websocket.query_params.get("api_key")):
        return True
    error = unauthorized()
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error.response())
    else:
        await websocket.accept()
        await websocket.send_json({"type": "error", **error.body()})
        await websocket.close(code=1008)
    return False

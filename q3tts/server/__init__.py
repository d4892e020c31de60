"""The HTTP server (`q3tts serve MODEL`): OpenAI-compatible speech, voices, streaming WebSocket, health and
metrics, in front of the continuous-batching engine. Needs the `server` extra (fastapi, uvicorn, av,
prometheus-client, python-multipart)."""

from __future__ import annotations

from .app import create_app, serve
from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "serve"]

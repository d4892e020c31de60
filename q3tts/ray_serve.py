"""Kept import path of q3tts on Ray Serve (`serve run q3tts.ray_serve:build_app ...`, README and deploy/ray/):
the code lives in `q3tts.server.ray_serve`."""

from __future__ import annotations

from .server.ray_serve import build_app

__all__ = ["build_app"]

"""The `q3tts` command line (`commands.py`): say, batch, voice, serve, bench."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]

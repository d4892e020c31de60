"""q3tts: fast, faithful inference for the Qwen3-TTS text-to-speech models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api.streaming import AudioChunk
    from .api.tts import TTS
    from .engine import EngineConfig, EngineError, QueueFull
    from .errors import RequestError
    from .request.builder import Request, RunawayGuard
    from .request.voice import Voice, VoiceClonePromptItem
    from .sampling import SamplingParams

    Qwen3TTSModel = TTS

# The public names load their modules on first use, so that `q3tts --help` answers at once (importing torch takes
# ~3 s).
_EXPORTS = {"TTS": (".api.tts", "TTS"), "Qwen3TTSModel": (".api.tts", "TTS"),  # drop-in name: api/official.py
            "EngineConfig": (".engine", "EngineConfig"), "EngineError": (".engine", "EngineError"),
            "QueueFull": (".engine", "QueueFull"), "RequestError": (".errors", "RequestError"),
            "Request": (".request.builder", "Request"), "RunawayGuard": (".request.builder", "RunawayGuard"),
            "SamplingParams": (".sampling", "SamplingParams"), "AudioChunk": (".api.streaming", "AudioChunk"),
            "Voice": (".request.voice", "Voice"), "VoiceClonePromptItem": (".request.voice", "VoiceClonePromptItem")}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = ["TTS", "AudioChunk", "EngineConfig", "EngineError", "Qwen3TTSModel", "QueueFull", "Request",
           "RequestError", "RunawayGuard", "SamplingParams", "Voice", "VoiceClonePromptItem"]
__version__ = "0.1.0"

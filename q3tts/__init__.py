"""q3tts: fast, faithful inference for the Qwen3-TTS text-to-speech models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import TTS
    from .engine import EngineConfig, EngineError, QueueFull
    from .errors import RequestError
    from .request import Request, RunawayGuard
    from .sampling import SamplingParams
    from .streaming import AudioChunk
    from .voice import Voice, VoiceClonePromptItem

    Qwen3TTSModel = TTS

# The public names load their modules on first use, so that `q3tts --help` answers at once (importing torch takes
# ~3 s).
_EXPORTS = {"TTS": (".api", "TTS"), "Qwen3TTSModel": (".api", "TTS"),  # drop-in name: q3tts/official.py
            "EngineConfig": (".engine", "EngineConfig"), "EngineError": (".engine", "EngineError"),
            "QueueFull": (".engine", "QueueFull"), "RequestError": (".errors", "RequestError"),
            "Request": (".request", "Request"), "RunawayGuard": (".request", "RunawayGuard"),
            "SamplingParams": (".sampling", "SamplingParams"), "AudioChunk": (".streaming", "AudioChunk"),
            "Voice": (".voice", "Voice"), "VoiceClonePromptItem": (".voice", "VoiceClonePromptItem")}


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

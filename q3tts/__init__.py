"""q3tts: fast, faithful inference for the Qwen3-TTS text-to-speech models."""

from __future__ import annotations

from .api import TTS
from .engine import EngineConfig, EngineError, QueueFull
from .errors import RequestError
from .request import Request, RunawayGuard
from .sampling import SamplingParams
from .streaming import AudioChunk
from .voice import Voice, VoiceClonePromptItem

Qwen3TTSModel = TTS  # drop-in name: `from q3tts import Qwen3TTSModel` (its methods: q3tts/official.py)

__all__ = ["TTS", "AudioChunk", "EngineConfig", "EngineError", "Qwen3TTSModel", "QueueFull", "Request",
           "RequestError", "RunawayGuard", "SamplingParams", "Voice", "VoiceClonePromptItem"]
__version__ = "0.1.0"

"""q3tts: fast, faithful inference for the Qwen3-TTS text-to-speech models."""

from __future__ import annotations

from .api import TTS
from .sampling import SamplingParams
from .voice import Voice, VoiceClonePromptItem

Qwen3TTSModel = TTS  # drop-in name: `from q3tts import Qwen3TTSModel`

__all__ = ["TTS", "Qwen3TTSModel", "SamplingParams", "Voice", "VoiceClonePromptItem"]
__version__ = "0.1.0"

"""The ids a request's `model` may name for the one model a server serves: its served name (`--served-model-name`,
default the MODEL argument), the MODEL argument itself and its folder's name, the official hub id of a checkpoint
of its kind and size (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`, with or without `Qwen/`), and OpenAI's speech model
ids with their dated snapshots (`tts-1`, `tts-1-hd-1106`, `gpt-4o-mini-tts-2025-12-15`), which clients written
for OpenAI send unchanged. Matched in any case.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from ..request.voice import size_name

OPENAI_MODELS = re.compile(r"tts-1(-hd)?(-\d{4})?|gpt-4o-mini-tts(-\d{4}-\d{2}-\d{2})?")
TASK_NAMES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base"}


def official_name(model_type: str, model_size: str) -> str:
    """The released checkpoint's name for this kind and size: Qwen3-TTS-12Hz-0.6B-Base."""
    return f"Qwen3-TTS-12Hz-{size_name(model_size)}-{TASK_NAMES.get(model_type, model_type)}"


def model_ids(served: str, model: str, model_type: str, model_size: str) -> list[str]:
    """The ids this server answers to besides OpenAI's, the served one first."""
    official = official_name(model_type, model_size)
    ids = [served, model, PurePath(model).name, f"Qwen/{official}", official]
    return list(dict.fromkeys(i for i in ids if i))


def is_served(name: str, ids: list[str]) -> bool:
    return name.lower() in (i.lower() for i in ids) or OPENAI_MODELS.fullmatch(name.lower()) is not None

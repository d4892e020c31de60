"""The engine: continuous batching of a loaded model's requests on its device (see `engine.py`).

request (`q3tts.request`) -> prompt (`q3tts.prompt`) -> `Engine.submit` -> scheduler -> model runner (talker +
code predictor, one CUDA graph per frame) -> sampler -> codec runner (incremental decode) -> `RequestStream`.
"""

from .config import EngineConfig
from .engine import Engine, EngineError, EngineMetrics
from .scheduler import QueueFull
from .stream import RequestStream

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineMetrics", "QueueFull", "RequestStream"]

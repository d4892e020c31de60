"""The engine, host side: continuous batching of a loaded model's requests on its device (see `engine.py`).

request (`q3tts.request`) -> prompt (`q3tts.request.prompt`) -> `Engine.submit` -> scheduler -> model runner
(`engine/runner/`: talker + code predictor, one CUDA graph per frame) -> sampler -> codec runner (incremental
decode) -> `RequestStream`.

The names below load their modules on first use (PEP 562), so that importing a host-side module alone (the
scheduler, the KV block bookkeeping) loads neither the runner nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import EngineConfig
    from .engine import Engine, EngineError, EngineMetrics
    from .scheduler import QueueFull
    from .stream import RequestStream

_EXPORTS = {"Engine": ".engine", "EngineConfig": ".config", "EngineError": ".engine", "EngineMetrics": ".engine",
            "QueueFull": ".scheduler", "RequestStream": ".stream"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = ["Engine", "EngineConfig", "EngineError", "EngineMetrics", "QueueFull", "RequestStream"]

"""`EngineKeeper`: a server's engine over its life. It builds the engine (graphs captured, one warm-up request
through it; `ready` only then), rebuilds it after a failure (up to MAX_RESTARTS times, then gives up: /health says
503 and the process exits under `q3tts serve`), and closes it at shutdown. The speech service (service.py) is one,
and adds the requests."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..engine import Engine
from .config import ServerConfig

if TYPE_CHECKING:
    from ..api.tts import TTS  # (the server loads it; the front, which imports this module, does not)

log = logging.getLogger("q3tts.server")
MAX_RESTARTS = 3  # engine rebuilds after failures before the server gives up


class EngineKeeper:
    """`tts`'s engine, configured by `config`. `observer` (the server's metrics) is told of every frame."""

    def __init__(self, tts: TTS, config: ServerConfig, observer: Any = None):
        self.tts, self.config, self.observer = tts, config, observer
        self.engine: Engine | None = None
        self.owns_engine = False  # built here (closed at stop), not shared with other users of the same TTS
        self.ready = False
        self.draining = False  # shutting down: running streams finish, new requests are refused
        self.failure: str | None = None
        self.restarts = 0  # engines rebuilt after a failure
        self.on_give_up: Callable[[], None] | None = None  # called when the engine cannot be rebuilt (serve(): exit)
        self._watchdog: asyncio.Task | None = None

    async def warm_up(self) -> None:
        """One request through a new engine before it is `ready` (the speech service's; here none)."""

    async def start(self) -> None:
        """Builds the engine (captures its graphs), runs one warm-up request through it, then sets `ready`."""
        try:
            if not self.tts.has_engine:
                self.tts.configure_engine(self.config.engine_config())
                self.owns_engine = True
            else:
                log.warning("the model's engine is already running: the server shares it as it is")
            self.engine = await asyncio.to_thread(self.tts.prepare_engine)
            if self.config.warmup:
                await self.warm_up()
            if self.observer is not None:
                self.engine.metrics.observers.append(self.observer)
            # What exists now (the model, the engine, the imports) lives as long as the process: out of the
            # garbage collector's sight, so that its full collections do not stall the engine for tens of ms.
            gc.collect()
            gc.freeze()
            if self.tts.device.type == "cuda":
                # Beside a GPU the process's CPU work is bookkeeping: this thread and the threads started later run
                # torch's CPU ops on one thread each (each thread's OpenMP team stays alive and slows the others';
                # docs/perf-notes.md, entry 73).
                torch.set_num_threads(1)
            self.ready = True
            log.info("engine ready: %s", self.config.model_id)
        except Exception as e:
            log.exception("engine start-up failed")
            self.failure = f"engine start-up failed: {e}"
            return
        if self.owns_engine and self._watchdog is None:
            self._watchdog = asyncio.create_task(self.watch())

    async def watch(self) -> None:
        """Rebuilds a failed engine (its streams have ended with an error event; meanwhile /ready and new requests
        say 503). After MAX_RESTARTS failures, or if a rebuild fails, gives up: /health says 503 and
        `on_give_up` (the process's exit under `q3tts serve`) lets a supervisor start it afresh."""
        while not self.draining:
            await asyncio.sleep(0.2)
            if self.engine is None or self.engine.healthy:
                continue
            self.ready = False
            self.restarts += 1
            log.error("the engine failed (%d so far); rebuilding it", self.restarts)
            try:
                if self.restarts > MAX_RESTARTS:
                    raise RuntimeError(f"the engine failed {self.restarts} times")
                await asyncio.to_thread(self.tts.close)
                self.tts.configure_engine(self.config.engine_config())
                self.engine = await asyncio.to_thread(self.tts.prepare_engine)
                if self.observer is not None:
                    self.engine.metrics.observers.append(self.observer)
                self.ready = True
            except Exception as e:
                log.exception("giving up on the engine")
                self.failure = f"the engine failed and could not be rebuilt: {e}"
                if self.on_give_up is not None:
                    self.on_give_up()
                return

    async def stop(self) -> None:
        self.ready = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.owns_engine:
            await asyncio.to_thread(self.tts.close)

    @property
    def healthy(self) -> bool:
        """Alive: not given up (a failed engine that is being rebuilt counts as alive)."""
        return self.failure is None

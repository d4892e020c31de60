"""The server's settings, validated once (the CLI reads the environment; nothing below does)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..serving.engine import ServingConfig


@dataclass
class ServerConfig:
    model: str  # checkpoint folder, hub id or a built-in tiny model name
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None  # one device per process: cuda, cuda:1, cpu
    dtype: str | None = None
    max_running: int = 64  # concurrent streams (rows of the engine's batch)
    max_waiting: int = 256  # queued requests before new ones get 429
    max_context: int = 4096  # talker positions per request (prompt + frames)
    max_input_chars: int = 4096
    api_key: str | None = None  # bearer token required on /v1/* when set
    voices_dir: Path | None = None  # where uploaded voices persist; None keeps them in memory
    served_model_name: str | None = None  # the id /v1/models reports (default: `model`)
    max_upload_bytes: int = 25 * 1024 * 1024
    warmup: bool = True  # run one request through the engine before /ready says yes

    def __post_init__(self):
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1 (every request waits in the queue before it runs)")
        if self.max_input_chars < 1 or self.max_upload_bytes < 1:
            raise ValueError("max_input_chars and max_upload_bytes must be >= 1")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.voices_dir is not None:
            self.voices_dir = Path(self.voices_dir)
        self.serving_config()  # validates max_running / max_context

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def serving_config(self) -> ServingConfig:
        return ServingConfig(max_running=self.max_running, max_waiting=self.max_waiting,
                             max_context=self.max_context)

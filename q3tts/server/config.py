"""The server's settings, validated once (the CLI reads the environment; nothing below does)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..engine import EngineConfig


@dataclass
class ServerConfig:
    model: str  # checkpoint folder, hub id or a built-in tiny model name
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None  # one device per process: cuda, cuda:1, cpu
    dtype: str | None = None  # default: bfloat16 on a GPU, float32 on the CPU
    max_running: int = 64  # concurrent streams (rows of the engine's batch)
    max_waiting: int = 256  # queued requests before new ones get 429
    max_context: int | None = None  # talker positions per request (prompt + frames); None: the model's limit
    gpu_memory_utilization: float | None = 0.9  # the GPU memory fraction the server may hold (the KV cache: the rest)
    kv_cache_gb: float | None = None  # or the KV cache's size itself
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
        self.engine_config()  # validates the engine's settings

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_rows=self.max_running, max_waiting=self.max_waiting, max_context=self.max_context,
                            kv_cache_gb=self.kv_cache_gb,
                            gpu_memory_utilization=None if self.kv_cache_gb else self.gpu_memory_utilization)

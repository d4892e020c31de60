"""The server's settings, validated once (the CLI reads the environment; nothing below does)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..engine import EngineConfig
from ..request.builder import RunawayGuard


@dataclass
class ServerConfig:
    model: str  # checkpoint folder, hub id or a built-in tiny model name
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None  # one device per process: cuda, cuda:1, cpu
    dtype: str | None = None  # default: bfloat16 on a GPU, float32 on the CPU
    lora: str | None = None  # a PEFT LoRA adapter (folder or hub id), merged into the weights at load
    max_running: int = 64  # concurrent streams (rows of the engine's batch)
    max_waiting: int = 256  # queued requests before new ones get 429
    max_context: int | None = None  # talker positions per request (prompt + frames); None: the model's limit
    gpu_memory_utilization: float | None = 0.9  # the GPU memory fraction the server may hold (the KV cache: the rest)
    kv_cache_gb: float | None = None  # or the KV cache's size itself
    prefix_cache_gb: float = 0.25  # voice prefixes' keys and values kept for reuse (0: off)
    api_key: str | None = None  # bearer token required on /v1/* when set
    voices_dir: Path | None = None  # where uploaded voices persist; None keeps them in memory
    served_model_name: str | None = None  # the id /v1/models reports (default: `model`)
    # Voice names beyond the checkpoint's own (voice_aliases.py): alias -> a preset speaker (CustomVoice), a
    # description (VoiceDesign) or a stored voice (Base); over the default table of OpenAI's voice names.
    voice_aliases: dict[str, str] = field(default_factory=dict)
    # For a request that names no voice (and, on Base, an OpenAI voice name with no stored voice of that name): a
    # preset speaker, a description, or a stored voice's name or a voice file / recording (Base).
    default_voice: str | None = None
    warmup: bool = True  # run one request through the engine before /ready says yes
    core_socket: str | None = None  # an engine process behind a front (front/app.py): its speech requests come here
    front_pid: int | None = None  # that front's process: the engine process stops when it is gone
    # Limits on what a client sends, checked before any work (README: "Limits").
    max_input_chars: int = 4096
    max_instructions_chars: int = 2000
    max_ref_text_chars: int = 2000
    max_voice_chars: int = 256  # a voice name or id
    max_upload_bytes: int = 25 * 1024 * 1024  # a reference recording (upload, base64 ref_audio or URL download)
    max_body_bytes: int | None = None  # a request body; None: room for a base64 upload, 4/3 x max_upload_bytes + 1 MiB
    body_timeout_s: float = 30.0  # each part of a request body must arrive within this
    send_timeout_s: float = 30.0  # a client that stops reading a stream for this long loses it (and its row)
    drain_timeout_s: float = 30.0  # on SIGTERM, streams in flight may finish for this long
    # ref_audio as an http(s) URL: off unless allowed; `ref_audio_hosts` allows those hosts only (and then their
    # private addresses too); otherwise public addresses only.
    # Ends a request whose audio far outgrows its text, or repeats itself (q3tts.request.RunawayGuard); None: off.
    runaway_guard: RunawayGuard | None = field(default_factory=RunawayGuard)
    allow_ref_audio_urls: bool = False
    ref_audio_hosts: tuple[str, ...] = ()
    ref_audio_timeout_s: float = 10.0

    def __post_init__(self):
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1 (every request waits in the queue before it runs)")
        limits = ("max_input_chars", "max_instructions_chars", "max_ref_text_chars", "max_voice_chars",
                  "max_upload_bytes", "body_timeout_s", "send_timeout_s", "drain_timeout_s", "ref_audio_timeout_s")
        for name in limits:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_body_bytes is None:
            self.max_body_bytes = self.max_upload_bytes * 4 // 3 + 2**20
        if not self.max_body_bytes > 0:
            raise ValueError(f"max_body_bytes must be > 0, got {self.max_body_bytes!r}")
        self.ref_audio_hosts = tuple(h.lower() for h in self.ref_audio_hosts)
        self._check_voices()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.voices_dir is not None:
            self.voices_dir = Path(self.voices_dir)
            try:  # (made here, not first at start-up, where a failure would be a traceback after the model loaded)
                self.voices_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"voices_dir {str(self.voices_dir)!r} cannot be a folder of voices: "
                                 f"{e.strerror or e}") from None
            if not os.access(self.voices_dir, os.W_OK | os.X_OK):
                raise ValueError(f"voices_dir {str(self.voices_dir)!r} cannot be a folder of voices: not writable")
            from .voice_store import VoiceStore

            VoiceStore(self.voices_dir)  # (a damaged index: refused here, in one line, before the model loads)
        self.engine_config()  # validates the engine's settings

    def _check_voices(self) -> None:
        """The aliases' form and a default voice file's existence (what they stand for is checked against the
        checkpoint once it is known: voice_aliases.py); the file as an absolute path, for engine processes."""
        from .voice_aliases import check_aliases, is_voice_file

        if not isinstance(self.voice_aliases, dict):
            raise ValueError(f"voice_aliases must be a mapping of names to voices, got {self.voice_aliases!r}")
        check_aliases(self.voice_aliases)
        if self.default_voice is not None and is_voice_file(self.default_voice):
            path = Path(self.default_voice).expanduser()
            if not path.is_file():
                raise ValueError(f"default_voice {self.default_voice!r}: no such file (a saved voice from `q3tts "
                                 "voice create`, a recording, or the name of a stored voice)")
            self.default_voice = str(path.resolve())

    @property
    def ref_audio_urls(self) -> bool:
        return self.allow_ref_audio_urls or bool(self.ref_audio_hosts)

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_rows=self.max_running, max_waiting=self.max_waiting, max_context=self.max_context,
                            kv_cache_gb=self.kv_cache_gb, prefix_cache_gb=self.prefix_cache_gb,
                            gpu_memory_utilization=None if self.kv_cache_gb else self.gpu_memory_utilization)

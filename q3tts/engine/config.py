"""The engine's settings, validated once, and how its KV cache is sized from a memory budget.

Memory: the weights, the row state, the codec's per-stream state and the CUDA graphs' pool take what they take;
the talker's paged KV cache takes the rest of the budget. The budget is, in order of precedence:
  * `kv_cache_gb`: the KV cache's size itself;
  * `gpu_memory_utilization`: the fraction of the GPU's memory this process may hold in all (vLLM's setting);
    the KV cache gets what remains after a profiling run of the largest batch (`Engine` measures it);
  * neither: `DEFAULT_KV_CACHE_GB` (less if the GPU has less free), enough for 64 typical requests at once
    (more wait, or are preempted and resumed).
Rows hold KV blocks as they grow, so the cache bounds the positions of all running requests together, not
rows x max_context. On the CPU the same settings apply to host memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# Every 32 rows above 64: a batch runs the next bucket up, and at 100-256 rows a frame's cost grows with its rows.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)
DEFAULT_KV_CACHE_GB = 2.0  # 1.7B or 0.6B at bf16: ~18,700 positions (~64 requests of 20 s with their prompts)
# Small models' default cache stops at max(this many positions per row, one full context): megabytes, not 2 GB.
DEFAULT_POSITIONS_PER_ROW = 1024
FUSED_DECODE = ("off", "attention", "all")


class ContextLimit(NamedTuple):
    """The talker positions one request may hold (prompt + frames), and the setting that bounds them (None: the
    model's own limit). The engine states it (`Engine.context_limit`); the request builder's length rule reads it."""

    positions: int
    setting: str | None


@dataclass
class EngineConfig:
    """How large the engine is. Every entry point of a loaded model shares one engine built from this."""

    max_rows: int = 64  # requests decoded together (rows of the batch); more wait in the queue
    max_context: int | None = None  # talker positions per request, prompt + frames; None: the model's limit
    kv_cache_gb: float | None = None  # the KV cache's size (see the module docstring)
    gpu_memory_utilization: float | None = None  # or: the fraction of the GPU's memory this process may hold
    max_waiting: int = 4096  # queued requests before `submit` raises QueueFull
    block_size: int = 64
    max_trailing: int = 4100  # trailing text ids per row (a request's text is at most 4,096 tokens)
    buckets: tuple[int, ...] = DEFAULT_BUCKETS  # batch sizes captured as CUDA graphs (those <= max_rows)
    # Prefill token counts captured as graphs; None: 32 to 512, up to 1024 / 2048 for engines of at least 32 / 64
    # rows (a burst of that many requests' prompts, at 10 to 40 positions each).
    prefill_buckets: tuple[int, ...] | None = None
    use_graphs: bool = True  # on CUDA; False runs every step eagerly
    max_prefill_tokens: int = 4096  # prefill tokens admitted per frame boundary
    prefill_seconds_per_token: float = 1e-4  # stall estimate the scheduler weighs against the streams' lead
    safety_seconds: float = 0.04  # lead kept beyond a stall: the next frame comes about two frame steps later
    # The interpreter's thread switch interval while the engine runs: after each frame the engine thread may
    # wait this long for the GIL if another thread is busy. Python's 5 ms default is half a frame step; None
    # leaves it alone.
    switch_interval: float | None = 0.001
    # A stream at least this many seconds of audio ahead of real-time playback gets its frames in groups of this
    # much audio, not one by one (engine/stream.py); 0 hands every frame out as it is made.
    stream_hold_s: float = 1.0
    # Decode steps with fewer kernels per layer (docs/perf-notes.md, entries 36 and 38): "attention": q/k norm,
    # RoPE, KV store and attention as one kernel (kernels.decode_attention) instead of two; "all": also the norms,
    # SwiGLU and residual adds inside the matrix products (kernels.fused_linear; bf16/fp16 weights, calls of up
    # to decoder.FUSED_MAX_ROWS tokens: 5 kernels per layer instead of 9); "off": neither.
    fused_decode: str = "all"
    # Voice prefixes kept for reuse across requests (engine/runner/prefix_cache.py): the talker's keys and values of
    # each voice's first positions, and the codec's state after each in-context voice's reference; each of the two
    # caches at most this much memory beside the KV cache; 0 turns both off.
    prefix_cache_gb: float = 0.25

    def __post_init__(self):
        if not isinstance(self.max_rows, int) or self.max_rows < 1:
            raise ValueError(f"max_rows must be a positive integer, got {self.max_rows!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 64):
            raise ValueError(f"max_context must be an integer >= 64 (or None: the model's limit), "
                             f"got {self.max_context!r}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not self.prefix_cache_gb >= 0:
            raise ValueError(f"prefix_cache_gb must be >= 0, got {self.prefix_cache_gb!r}")
        if self.fused_decode not in FUSED_DECODE:
            raise ValueError(f"fused_decode must be one of {', '.join(FUSED_DECODE)}, got {self.fused_decode!r}")
        if not self.stream_hold_s >= 0:
            raise ValueError(f"stream_hold_s must be >= 0 seconds, got {self.stream_hold_s!r}")
        if self.max_waiting < 0 or self.block_size < 16 or self.max_prefill_tokens < 1:
            raise ValueError("max_waiting >= 0, block_size >= 16 and max_prefill_tokens >= 1 are required")
        self.buckets = tuple(sorted(b for b in self.buckets if b <= self.max_rows))
        if not self.buckets or self.buckets[-1] != self.max_rows:
            self.buckets = (*self.buckets, self.max_rows)
        if self.prefill_buckets is None:  # (steps of at most 1.5x: a prefill pads at most a third)
            self.prefill_buckets = (32, 64, 96, 128, 192, 256, 384, 512) + (768, 1024) * (self.max_rows >= 32) + (
                1536, 2048) * (self.max_rows >= 64)
        if any(b < 1 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive token counts, got {self.prefill_buckets}")
        self.prefill_buckets = tuple(sorted(self.prefill_buckets))  # () captures none: every prefill runs eagerly

    def context_for(self, model_limit: int) -> int:
        """Positions per request: max_context, at most the model's own limit."""
        if self.max_context is not None and self.max_context > model_limit:
            raise ValueError(f"max_context {self.max_context} exceeds the model's {model_limit} positions")
        return self.max_context or model_limit

    def kv_blocks(self, bytes_per_block: int, max_context: int, available_bytes: float | None) -> int:
        """Blocks of the KV cache (block 0 included). `available_bytes`: what the GPU memory utilization leaves
        for the cache after everything else (None off the GPU or when the setting is unused)."""
        most = self.max_rows * -(-max_context // self.block_size) + 2  # never useful beyond this
        if self.kv_cache_gb is not None:
            wanted = int(self.kv_cache_gb * 2**30 // bytes_per_block)
        elif self.gpu_memory_utilization is not None and available_bytes is not None:
            wanted = int(available_bytes // bytes_per_block)
        else:
            default = int(DEFAULT_KV_CACHE_GB * 2**30 // bytes_per_block)
            positions = max(self.max_rows * DEFAULT_POSITIONS_PER_ROW, max_context)
            wanted = min(default, positions // self.block_size + 2)
            if available_bytes is not None:
                wanted = min(wanted, int(available_bytes // bytes_per_block))
        return max(min(wanted, most), 2)

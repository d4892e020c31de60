"""The device's memory and graphs at an engine's start: the KV cache sized from the memory budget after a profiling
run of the largest batch (as vLLM does), then the CUDA graphs captured (in the engine's thread: graphs.py says
why). On a CPU the runner's default cache stays and nothing is captured."""

from __future__ import annotations

import logging

import torch

from ..config import EngineConfig
from .codec import CodecRunner
from .graphs import side_stream
from .model_runner import ModelRunner

log = logging.getLogger("q3tts.engine")


def size_kv_cache(runner: ModelRunner, codec: CodecRunner, config: EngineConfig) -> None:
    """Allocates the KV cache from the memory budget (see engine/config.py). On CUDA, what the largest batch
    needs besides the cache is measured first by running it once."""
    device = runner.device
    if device.type != "cuda":
        return  # the runner's default cache
    peak = profile_peak_bytes(runner, codec, config)
    free, total = torch.cuda.mem_get_info(device)
    fraction = config.gpu_memory_utilization or 0.9
    # The graphs' pool will hold about the profiled peak; cuBLAS workspaces and fragmentation the margin.
    available = fraction * total - (total - free) - 1.2 * peak - 256 * 2**20 - 2 * config.prefix_cache_gb * 2**30
    if config.gpu_memory_utilization is not None and available < 16 * runner.kv_bytes_per_block:
        raise MemoryError(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for the KV cache "
                          f"({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use, {peak / 2**30:.1f} "
                          f"GiB needed to run {config.max_rows} rows): raise it or lower max_rows")
    blocks = config.kv_blocks(runner.kv_bytes_per_block, runner.max_context, available)
    try:
        runner.allocate_kv_cache(blocks)
    except torch.OutOfMemoryError as e:
        raise MemoryError(f"the KV cache ({blocks * runner.kv_bytes_per_block / 2**30:.2f} GiB) does not fit "
                          f"this device: lower kv_cache_gb or gpu_memory_utilization") from e
    log.info("KV cache: %d blocks of %d positions (%.2f GiB)", blocks, config.block_size,
             blocks * runner.kv_bytes_per_block / 2**30)


@torch.no_grad()
def profile_peak_bytes(runner: ModelRunner, codec: CodecRunner, config: EngineConfig) -> int:
    """GPU memory the largest frame, prefill and codec step take beyond what is allocated now."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    largest = config.buckets[-1]
    runner.frame(largest)
    if config.prefill_buckets:
        runner.prefill(config.prefill_buckets[-1])
    codec.step(largest)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    runner.reset_state()
    codec.stream.reset(list(range(config.max_rows)))
    torch.cuda.empty_cache()
    return peak


def capture_graphs(runner: ModelRunner, codec: CodecRunner, config: EngineConfig) -> None:
    """On a GPU, in the engine's thread: the language model's graphs on a stream of their own, the codec's on the
    codec's stream (graphs.py)."""
    if runner.device.type != "cuda":
        return
    torch.cuda.set_device(runner.device)  # a new thread starts on device 0
    if config.use_graphs:
        runner.capture_graphs(side_stream(avoid=codec.pcm_stream))
        codec.capture_graphs()

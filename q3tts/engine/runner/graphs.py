"""CUDA graphs: one per batch bucket, captured at start-up, replayed in the loop (eager where none exists).

cuBLAS keeps one workspace per (handle, stream); PyTorch gives each thread its own handle, and a graph keeps the
workspace of the thread and stream it was captured on. Two graphs, or a graph and eager matrix products, that
share a workspace must never run at the same time. So the engine captures its graphs in its own thread (no
other thread's eager work shares their workspaces: prompt building on callers' threads, another model's
engine), the codec's on the codec's stream (its eager work runs there too, in order), the language model's on a
stream of its own that is not the codec's (they overlap).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_buckets(run: Callable[[int], None], buckets: tuple[int, ...], stream: torch.cuda.Stream
                    ) -> dict[int, torch.cuda.CUDAGraph]:
    """One CUDA graph of `run(B)` per bucket, largest first, all in one memory pool (nano-vllm's order: the
    largest bucket's allocations are reused by the smaller ones), captured on `stream` (see the module's
    docstring). Each is run once eagerly first, which compiles the Triton kernels and lets cuBLAS and cuDNN pick
    their algorithms outside the capture. Other threads may use the GPU meanwhile (thread-local capture mode)."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for B in sorted(buckets, reverse=True):
        with torch.cuda.stream(stream):
            run(B)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            run(B)
        graphs[B] = graph
    stream.synchronize()
    return graphs


def side_stream(avoid: torch.cuda.Stream | None = None) -> torch.cuda.Stream:
    """A stream from PyTorch's pool (32 per priority, handed out in turn) that is not `avoid`."""
    while True:
        stream = torch.cuda.Stream()
        if avoid is None or stream.cuda_stream != avoid.cuda_stream:
            return stream


def replay_or_run(graphs: dict[int, torch.cuda.CUDAGraph], run: Callable[[int], None], bucket: int) -> None:
    """Replays the bucket's captured graph of `run`, or runs it eagerly where none was captured."""
    graph = graphs.get(bucket)
    if graph is not None:
        graph.replay()
    else:
        run(bucket)

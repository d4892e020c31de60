"""CUDA graphs: one per batch bucket, captured at start-up, replayed in the loop (eager where none exists)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch


def capture_buckets(run: Callable[[int], None], buckets: tuple[int, ...], stream: torch.cuda.Stream | None = None
                    ) -> dict[int, torch.cuda.CUDAGraph]:
    """One CUDA graph of `run(B)` per bucket, largest first, all in one memory pool (nano-vllm's order: the
    largest bucket's allocations are reused by the smaller ones). Each is run once eagerly first, which
    compiles the Triton kernels and lets cuBLAS and cuDNN pick their algorithms outside the capture.

    Graphs that will replay concurrently with others must be captured on a `stream` of their own: cuBLAS keeps
    one workspace per (handle, stream), and a graph captures the capture stream's, so two graphs captured on
    the same stream share a workspace and race on it when they run at the same time."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    for B in sorted(buckets, reverse=True):
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            run(B)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            run(B)
        graphs[B] = graph
    torch.cuda.synchronize()
    return graphs


def replay_or_run(graphs: dict[int, torch.cuda.CUDAGraph], run: Callable[[int], None], bucket: int) -> None:
    """Replays the bucket's captured graph of `run`, or runs it eagerly where none was captured."""
    graph = graphs.get(bucket)
    if graph is not None:
        graph.replay()
    else:
        run(bucket)

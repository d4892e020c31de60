"""The engine's persistent layer tail (q3tts/kernels/persistent.py) alone at 64 or 128 rows: one launch (o, add +
RMSNorm, gate/up + SwiGLU, down, add + RMSNorm, the next qkv) against the kernels per step that it replaces, in CUDA
graphs over distinct weights (cold L2), and where its time goes: each program's clock at each phase's start and end (the
phase's own time, slowest program, and the wait at the barrier after it). GPU machine only (Hopper).

usage: python bench/profilers/layer_tail.py [--shapes 1024x3072,2048x6144] [--rows 64,128] [--layers 8]
       [--rings 6:128,8:96]   (--rings: weight-tile slots : KB of input chunks, each pair a run)
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from q3tts.kernels import persistent
from q3tts.kernels.activation import silu_mul
from q3tts.kernels.norm import add_rmsnorm
from q3tts.layers.attention import FusedLayerWeights

PHASES = ["o", "norm", "gate/up", "down", "norm", "qkv"]


def graph_ms(fn, replays: int = 50) -> float:
    """GPU ms of one call of `fn` captured in a CUDA graph: the median of `replays` replays, each timed alone (as
    the persistent probe of perf-notes 79 timed them, so that this script's numbers compare with its)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer(hidden: int, inter: int, g: torch.Generator) -> FusedLayerWeights:
    rand = lambda *s: (torch.randn(*s, generator=g) * s[-1] ** -0.5).to("cuda", torch.bfloat16)
    norm = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to("cuda", torch.bfloat16)
    return FusedLayerWeights(qkv=rand(4096, hidden), o=rand(hidden, 2048), gate_up=rand(2 * inter, hidden),
                             down=rand(hidden, inter), input_norm=norm(hidden), post_norm=norm(hidden),
                             q_norm=norm(128), k_norm=norm(128))


def per_kernels(attended, res, w, after, eps):
    h, res = add_rmsnorm(F.linear(attended, w.o), res, w.post_norm, eps, attended.dtype)
    h = F.linear(silu_mul(F.linear(h, w.gate_up)), w.down)
    xn, res = add_rmsnorm(h, res, after.input_norm, eps, attended.dtype)
    return F.linear(xn, after.qkv)


def phases(times: torch.Tensor, launch_us: float) -> dict:
    t = times.double()  # [programs, 6, 2]
    work = t[:, :, 1] - t[:, :, 0]
    wait = t[:, 1:, 0] - t[:, :-1, 1]
    per_us = (t[:, -1, 1] - t[:, 0, 0]).max().item() / launch_us
    return {f"{k} {name}": {"work_max_us": round(work[:, k].max().item() / per_us, 2),
                            "work_median_us": round(work[:, k].median().item() / per_us, 2),
                            "wait_after_us": round(wait[:, k].median().item() / per_us, 2) if k < 5 else None}
            for k, name in enumerate(PHASES)}


def tails(tail, attended, res0, res, layers, times=None):
    for i in range(len(layers) - 1):
        tail(attended, res0, res, layers[i], layers[i + 1], layers[i + 1].input_norm, 1e-6, times)


def measure(hidden: int, inter: int, rows: int, n: int, rings: list[str], g: torch.Generator):
    layers = [layer(hidden, inter, g) for _ in range(n + 1)]
    attended = torch.randn(rows, 2048, generator=g).to("cuda", torch.bfloat16)
    res0 = torch.randn(rows, hidden, generator=g).to("cuda")
    res = res0.clone()
    tail = persistent.LayerTail(torch.device("cuda"))

    def steps():
        for i in range(n):
            per_kernels(attended, res0, layers[i], layers[i + 1], 1e-6)

    shape = f"{rows}x{hidden}x{inter}"
    print(json.dumps({"shape": shape, "programs": tail.programs, "layers": n,
                      "per_kernels_us": 1e3 * graph_ms(steps) / n}), flush=True)
    for ring in rings:
        stages, input_kb = (int(v) for v in ring.split(":"))
        persistent.STAGES, persistent.INPUT_BYTES = stages, input_kb * 1024
        row = {"shape": shape, "rings": ring,
               "persistent_us": 1e3 * graph_ms(partial(tails, tail, attended, res0, res, layers)) / n}
        times = torch.zeros(tail.programs, 6, 2, dtype=torch.int64, device="cuda")
        timed_us = 1e3 * graph_ms(partial(tails, tail, attended, res0, res, layers[:2], times))
        row |= {"timed_launch_us": round(timed_us, 2), "phases": phases(times.cpu(), timed_us),
                "barrier_error": tail.sync[1].item()}
        print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1024x3072,2048x6144", help="hidden x intermediate, comma-separated")
    parser.add_argument("--rows", default="64,128")
    parser.add_argument("--layers", type=int, default=8, help="distinct layers per graph (beyond the L2)")
    parser.add_argument("--rings", default=f"{persistent.STAGES}:{persistent.INPUT_BYTES // 1024}")
    args = parser.parse_args()
    g = torch.Generator("cpu").manual_seed(0)
    for shape in args.shapes.split(","):
        hidden, inter = (int(v) for v in shape.split("x"))
        for rows in args.rows.split(","):
            measure(hidden, inter, int(rows), args.layers, args.rings.split(","), g)


if __name__ == "__main__":
    main()

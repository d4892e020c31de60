"""What a frame costs as its rows' context grows, and what the talker's decode attention costs alone.

`q3tts bench decode` reports ms per frame between frames n_short and n_long (30 and 130: contexts ~40-150),
`bench/frame_parts.py` the frame at the prompt's own length; this script says how far apart those are and why:
(1) the frame graph replayed `--frames` times from admission, timed in segments of `--every` frames by CUDA
events (ms per frame against the rows' mean context), (2) the talker's decode attention kernel alone at the
talker's shapes for each context in `--contexts`, every row at that context (graph-timed, 28 calls per replay:
a frame's worth). Random weights at the real configs, EOS off. GPU machine only.

usage: python bench/profilers/context_cost.py [--sizes 0.6B-Base,1.7B-Base] [--batches 1,64] [--frames 440] [--every 60]
                                    [--contexts 16,64,128,256,448]
"""

from __future__ import annotations

import argparse

import torch

from q3tts.benchmarks.common import clone_prompt, graph_ms, load_model
from q3tts.benchmarks.decode import decode_runner
from q3tts.kernels.attention import decode_attention
from q3tts.sampling import SamplingParams


def frame_segments(runner, prompt, batch: int, frames: int, every: int) -> list[tuple[int, float]]:
    """[(mean context of the segment, ms per frame)] over `frames` frames from admission."""
    rows = list(range(batch))
    runner.add_rows(rows, [prompt] * batch, [SamplingParams(max_new_tokens=frames + 1, seed=i) for i in rows])
    for row in rows:
        runner.grow(row, prompt.num_positions + frames + 1)
    marks = []
    for i in range(frames + 1):
        if i % every == 0:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((i, event))
        if i < frames:
            runner.step(batch)
    torch.cuda.synchronize()
    runner.release_rows(rows)
    return [(prompt.num_positions + (a + b) // 2, start.elapsed_time(end) / (b - a))
            for (a, start), (b, end) in zip(marks, marks[1:])]


def attention_us(batch: int, context: int, block_size: int = 64, heads: int = 16, kv: int = 8, D: int = 128) -> float:
    """The talker's decode attention for `batch` rows at position context - 1, us per call."""
    dev = torch.device("cuda")
    per_row = -(-context // block_size)
    blocks = batch * per_row + 1
    table = (torch.randperm(blocks - 1, device=dev)[: batch * per_row] + 1).view(batch, per_row).int()
    cache = lambda: torch.randn(blocks, block_size, kv, D, device=dev, dtype=torch.bfloat16)
    args = dict(qkv=torch.randn(batch, (heads + 2 * kv) * D, device=dev, dtype=torch.bfloat16),
                q_norm=torch.ones(D, device=dev, dtype=torch.bfloat16),
                k_norm=torch.ones(D, device=dev, dtype=torch.bfloat16), eps=1e-6,
                inv_freq=1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D)),
                rows=torch.arange(batch, device=dev, dtype=torch.int32),
                positions=torch.full((batch,), context - 1, device=dev, dtype=torch.int32), block_table=table,
                k_cache=cache(), v_cache=cache(), num_heads=heads, out_dtype=torch.bfloat16)
    return graph_ms(lambda: decode_attention(**args), 50, reps=28) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.6B-Base,1.7B-Base")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--frames", type=int, default=440)
    parser.add_argument("--every", type=int, default=60)
    parser.add_argument("--contexts", default="16,64,128,256,448")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        times = {c: round(attention_us(batch, c), 2) for c in map(int, args.contexts.split(","))}
        print("attention us per call", batch, "rows, by context:", times, flush=True)
    for name in args.sizes.split(","):
        model = load_model(name, None, torch.device("cuda"))
        prompt = clone_prompt(model)
        runner = decode_runner(model, prompt, batches, frames=args.frames + 1)
        runner.capture_graphs()
        for batch in batches:
            segments = frame_segments(runner, prompt, batch, args.frames, args.every)
            print(name, batch, "ms per frame by context:",
                  ", ".join(f"{c}: {ms:.3f}" for c, ms in segments), flush=True)
        del runner, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

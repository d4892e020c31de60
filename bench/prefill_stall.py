"""How long admitting newcomers stalls the running streams (GPU machine).

With `running` rows decoding, admits `k` prompts of a given length (ModelRunner.add_rows: prefill + arming) and
times the call to completion on the GPU, with the prefill graphs and eagerly, next to one decode frame of the
running batch. Then the cost of churn in a pipelined loop (see `churn`), with the host-to-device copies of
admission staged in pinned memory and with plain (synchronizing) copies. Random full-size weights.

usage: python bench/prefill_stall.py [--size 1.7B-Base] [--running 32] [--out FILE]
"""

import argparse
import time
from pathlib import Path

import torch

from q3tts import transfer
from q3tts.benchmarks.common import clone_prompt, load_model, write_results
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.sampling import SamplingParams

CASES = [(1, 12), (1, 40), (4, 40), (1, 120), (8, 60), (1, 400)]  # (prompts admitted, text tokens each)


def prompt(model, text_tokens: int, seed: int):
    return clone_prompt(model, text_tokens, seed=seed, non_streaming=True)


def timed_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def churn(runner, model, size: str, running: int, params, frames: int = 200, every: int = 4) -> dict:
    """The serving loop's pattern without the codec: frames run one ahead of the host (it waits for the frame
    before last, as the engine's readback does), and every `every` frames one request finishes and one is
    admitted. The cost of churn is the per-frame time beyond the plain loop's: the admission's GPU work plus any
    bubble in which the device waits for the host."""
    prompts = [prompt(model, 12, seed=200 + i) for i in range(frames // every)]

    def loop(admit: bool) -> float:
        events: list = []
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(frames):
            if admit and i % every == 0:
                runner.release_rows([running - 1])
                runner.add_rows([running - 1], [prompts[i // every]], [params])
                runner.grow(running - 1, prompts[i // every].num_positions + frames + 1)
            runner.step(running)
            events.append(torch.cuda.Event())
            events[-1].record()
            if len(events) > 1:
                events[-2].synchronize()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3 / frames

    plain, with_churn = loop(False), loop(True)
    return {"engine": "q3tts", "model": size, "running_streams": running,
            "churn": f"1 finish + 1 admission every {every} frames", "frame_ms_plain": round(plain, 3),
            "frame_ms_with_churn": round(with_churn, 3),
            "admission_cost_ms": round((with_churn - plain) * every, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.7B-Base")
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("prefill-stall.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    model = load_model(args.size, None, dev)
    runner = ModelRunner(model, EngineConfig(max_rows=64, max_context=2048))
    runner.capture_graphs()
    params = SamplingParams(max_new_tokens=1000, seed=1)
    base = [prompt(model, 12, seed=i) for i in range(args.running)]
    runner.add_rows(list(range(args.running)), base, [params] * args.running)
    for row, p in enumerate(base):  # the engine grows rows a block at a time; here every block up front
        runner.grow(row, p.num_positions + 1000)
    for _ in range(3):
        runner.step(args.running)
    frame = timed_ms(lambda: runner.step(args.running))
    graphs = runner.prefill_graphs
    rows = []
    for k, n in CASES:
        prompts = [prompt(model, n, seed=100 + i) for i in range(k)]
        new_rows = list(range(args.running, args.running + k))

        def admit(new_rows=new_rows, prompts=prompts):
            runner.add_rows(new_rows, prompts, [params] * len(prompts))
            runner.release_rows(new_rows)

        tokens = sum(p.embeds.shape[0] for p in prompts)
        runner.prefill_graphs = graphs
        with_graphs = timed_ms(admit)
        runner.prefill_graphs = {}
        eager = timed_ms(admit)
        runner.prefill_graphs = graphs
        rows.append({"engine": "q3tts", "model": args.size, "running_streams": args.running, "admitted": k,
                     "prefill_tokens": tokens, "admit_ms_graphs": round(with_graphs, 3),
                     "admit_ms_eager": round(eager, 3), "frame_ms": round(frame, 3)})
        print(rows[-1], flush=True)
    for pinned in (True, False):  # host-to-device copies staged in pinned memory, or pageable (synchronizing)
        transfer.PINNED = pinned
        rows.append(churn(runner, model, args.size, args.running, params) | {"pinned_copies": pinned})
        print(rows[-1], flush=True)
    transfer.PINNED = True
    write_results(rows, args.out, "python bench/prefill_stall.py " + " ".join(f"--{k} {v}" for k, v in
                                                                             vars(args).items() if k != "out"))


if __name__ == "__main__":
    main()

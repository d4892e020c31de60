"""Where a burst's first audio goes, step by step: `batch` requests in one voice (x-vector, or in-context with
`--ref-seconds`; or each in a new x-vector voice, `--new-voices`) submitted together, as `q3tts bench streaming`
times them, with the device synchronised around each step of prompt building, row setup, prefill, codec start,
first frame and its decode (each step's host and synchronised ms, median of `--reps`). GPU machine only.

usage: python bench/profilers/profile_burst.py [--model 1.7B-Base] [--batch 64] [--ref-seconds 0] [--cached]
                                              [--new-voices] [--reps 5] [--torch-profile]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from q3tts.benchmarks.common import load_model, random_decoder, voice_prompt
from q3tts.benchmarks.streaming import burst_specs, streaming_engine
from q3tts.engine.runner.readback import Readback
from q3tts.request.prompt import build_prompts
from q3tts.sampling import SamplingParams

_sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def synced(totals: collections.Counter, label: str, fn):
    """`fn` with the device synchronised before and after, its wall ms added to totals[label]."""
    def timed(*args, **kwargs):
        _sync()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            totals[label] += (time.perf_counter() - t) * 1e3
    return timed


def burst(engine, model, batch: int, ref_seconds: float, cached: bool, new_voices: bool = False
          ) -> collections.Counter:
    runner, codec = engine.runner, engine.codec
    totals: collections.Counter = collections.Counter()
    saved = runner.prefix_cache, codec.references
    if not cached:
        runner.prefix_cache = codec.references = None
    else:
        prompt, ref_codes = voice_prompt(model, seed=0, ref_seconds=ref_seconds, text_seed=batch + 1)
        runner.add_rows([0], [prompt], [SamplingParams(max_new_tokens=20)])
        codec.start([0], [ref_codes])
        runner.release_rows([0])
    originals = {name: getattr(runner, name) for name in ("grow", "_reuse_prefixes", "_prefill_tokens")}
    for name, fn in originals.items():
        setattr(runner, name, synced(totals, f"add_rows.{name}", fn))
    try:
        specs = burst_specs(model, batch, ref_seconds, new_voices)
        rows = list(range(batch))
        params = [SamplingParams(max_new_tokens=20, seed=i) for i in rows]
        prompts = synced(totals, "build_prompts", build_prompts)(model.talker, model.config, specs)
        synced(totals, "add_rows", runner.add_rows)(rows, prompts, params)
        synced(totals, "codec.start", codec.start)(rows, [spec.ref_codes for spec in specs])
        readback = Readback(runner, depth=2, pcm=codec.pcm, pcm_stream=codec.pcm_stream)
        synced(totals, "frame", runner.step)(batch)
        synced(totals, "codec.step", codec.step)(batch)
        synced(totals, "readback", lambda: (readback.push(batch), readback.pop()))()
        runner.release_rows(rows)
    finally:
        for name in originals:
            delattr(runner, name)  # (the class's method again)
        runner.prefix_cache, codec.references = saved
    totals["add_rows.other"] = totals["add_rows"] - sum(v for k, v in totals.items() if k.startswith("add_rows."))
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.7B-Base")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ref-seconds", type=float, default=0.0)
    parser.add_argument("--cached", action="store_true", help="the voice's prefix is in the caches beforehand")
    parser.add_argument("--new-voices", action="store_true", help="each request in an x-vector voice never seen before")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--torch-profile", action="store_true", help="also print the GPU kernels of one burst")
    args = parser.parse_args()
    model = load_model(args.model, None, torch.device("cuda"))
    engine = streaming_engine(model, random_decoder(torch.device("cuda"), torch.bfloat16), (args.batch,))
    kind = (args.batch, args.ref_seconds, args.cached, args.new_voices)
    burst(engine, model, *kind)  # warm-up
    runs = [burst(engine, model, *kind) for _ in range(args.reps)]
    voice = "new x-vector voices" if args.new_voices else f"in-context {args.ref_seconds:g} s" if args.ref_seconds \
        else "x-vector"
    print(f"{args.model}, {args.batch} requests, {voice}, prefix {'cached' if args.cached else 'not cached'} "
          f"(synchronised ms, median of {args.reps}):")
    for label in sorted(runs[0]):
        print(f"  {label:<32} {statistics.median(r[label] for r in runs):8.2f}")
    top = [k for k in runs[0] if "." not in k or k.startswith("codec.")]
    print(f"  {'sum of steps':<32} {statistics.median(sum(r[k] for k in top) for r in runs):8.2f}")
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            burst(engine, model, *kind)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    engine.stop()


if __name__ == "__main__":
    main()

"""GPU memory of one model's engine, stage by stage: weights, engine build (KV cache, graphs), one request.

usage: python bench/memory.py [--size 1.7B-Base] [--max-rows 1] [--kv-cache-gb G]   (GPU machine)
"""

from __future__ import annotations

import argparse

import torch

from q3tts.benchmarks.common import clone_prompt, load_model, random_decoder
from q3tts.engine import Engine, EngineConfig
from q3tts.sampling import SamplingParams


def mark(label: str) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    print(f"{label:<28} allocated {torch.cuda.memory_allocated() / 1e9:6.2f} GB  reserved "
          f"{torch.cuda.memory_reserved() / 1e9:6.2f} GB  peak reserved {torch.cuda.max_memory_reserved() / 1e9:6.2f} "
          f"GB  device used {(total - free) / 1e9:6.2f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1.7B-Base")
    parser.add_argument("--max-rows", type=int, default=1)
    parser.add_argument("--kv-cache-gb", type=float)
    args = parser.parse_args()
    device = torch.device("cuda")
    mark("start")
    model = load_model(args.size, None, device)
    decoder = random_decoder(device, torch.bfloat16)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    mark("weights (LM + codec decoder)")
    engine = Engine(model, decoder, EngineConfig(max_rows=args.max_rows, kv_cache_gb=args.kv_cache_gb))
    kv = engine.runner.kv.num_blocks * engine.runner.kv_bytes_per_block
    mark(f"engine built (KV {kv / 1e9:.2f} GB)")
    audio = engine.submit(clone_prompt(model), SamplingParams(max_new_tokens=126, seed=0)).read_all()
    assert audio.shape == (125 * 1920,)
    mark("after a 10 s request")
    engine.stop()


if __name__ == "__main__":
    main()

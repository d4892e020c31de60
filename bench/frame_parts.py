"""Graph-timed parts of the frame (the whole frame, talker, code predictor, sampling; `q3tts bench decode
--breakdown` prints the same) for A/B comparisons on one machine: run it once per setting from the tree under
test, alternating the settings and repeating the rounds, so that machine-to-machine spread (perf-notes 39, 46)
does not enter the comparison:

    for r in 1 2; do for tree in /tmp/base $PWD; do
        PYTHONPATH=$tree python bench/frame_parts.py --label $tree --sizes 0.6B-Base --batches 1,64
    done; done

`--tiles`: a bench/sweeps/fused_linear.py --out table laid over the committed tile tables (the sweep's tiles in the
frame without a commit); `--fused-decode`: EngineConfig.fused_decode;
`--set engine.runner.transformer.FUSED_MAX_ROWS=2`: a constant of a q3tts module, for the run. Random weights
at the real configs with EOS off. GPU machine only.

usage: python bench/frame_parts.py [--sizes 0.6B-Base,1.7B-Base] [--batches 1,2] [--fused-decode all]
                                   [--tiles tiles.json] [--set MODULE.NAME=VALUE ...] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from q3tts.benchmarks.common import ab_label, add_ab_options, clone_prompt, load_model
from q3tts.benchmarks.decode import breakdown, decode_runner
from q3tts.engine import EngineConfig
from q3tts.kernels import linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.6B-Base,1.7B-Base")
    parser.add_argument("--batches", default="1,2")
    parser.add_argument("--fused-decode", default=EngineConfig.fused_decode)
    parser.add_argument("--tiles", type=Path, help="bench/sweeps/fused_linear.py --out JSON laid over the tile tables")
    add_ab_options(parser)
    args = parser.parse_args()
    label = ab_label(args)
    if args.tiles:
        for table, key, tiles in json.loads(args.tiles.read_text()):
            getattr(linear, table)[tuple(key)] = tuple(tiles)
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.sizes.split(","):
        model = load_model(name, None, torch.device("cuda"))
        prompt = clone_prompt(model)
        runner = decode_runner(model, prompt, batches, args.fused_decode)  # (as `q3tts bench decode` builds it)
        runner.capture_graphs()
        for batch in batches:
            parts = {k: round(v, 3) for k, v in breakdown(runner, prompt, batch).items()}
            print(label, name, batch, parts, flush=True)
        del runner, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

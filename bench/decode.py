"""Decode benchmark on the GPU machine (same as `q3tts bench decode`); see q3tts/benchmarks/decode.py.

usage: python bench/decode.py [--sizes 0.6B-Base,1.7B-Base] [--batches 1,2,...,256] [--out FILE] ...
"""

import sys

from q3tts.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "decode", *sys.argv[1:]]))

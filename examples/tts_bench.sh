#!/usr/bin/env bash
# nari-labs' tts-bench (github.com/nari-labs/benchmarks, tts_bench/) against q3tts, once per target contract: q3tts
# answers each the way that engine does, so the benchmark's numbers compare like with like.
#   cd benchmarks/tts_bench && uv sync && uv run bench dataset prepare      # once: the 1,088 Seed-TTS prompts
#   q3tts serve Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice                       # http://127.0.0.1:8000
#   bash examples/tts_bench.sh [BASE_URL] [RPS]
# tts-bench's defaults: model Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice (the checkpoint's hub id, which q3tts accepts as
# the served model), voice Ryan, language English, 10 s warm-up, 30 s measured, Poisson arrivals. A tiny random
# model (`q3tts serve tiny`) never ends on its own: add `--request-param max_new_tokens=50`.
set -euo pipefail
BASE_URL=${1:-http://127.0.0.1:8000}
RPS=${2:-8}
for target in vllm-omni sglang-omni voxserve mstar nari; do
  bench run --target "$target" --base-url "$BASE_URL" --dataset datasets/seed-tts-eval.jsonl --rps "$RPS" \
    --output "results/q3tts-$target-rps-$RPS"
done

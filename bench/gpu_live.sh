#!/usr/bin/env bash
# One device call for live text on the GPU: tts-bench (the real CLI) against `q3tts serve` with
# the random 1.7B CustomVoice checkpoint (EOS off) over nari's WebSocket protocol (live text: one word every 10 ms)
# and over HTTP at one rate for comparison with the committed HTTP rows, then bench/live_text.py in-process (live
# text beside sentence cuts, at 1 and 64 sessions started together) on the same checkpoint, then the GPU tests
# (last: the ladders' DEADLINE counts from the call's start). Carry .benchwhl and .gpuwhl.
#   COMMIT=<short hash> bash bench/gpu_live.sh            (OUT=$OUT on the device machine)
# Knobs: WS_RATES="20 100 175" RATES="100" LIVE_SESSIONS="1 64" LIVE_S=200 GPU_TESTS=1 GPU_TESTS_S=240, and ladder.sh's
# (DEADLINE, DURATION, WS_SEEDS, ...).
source "$(dirname "$0")/device_call.sh" /tmp/gpu_live gpu_live.txt
log "tts-bench"
WS=1 WS_RATES=${WS_RATES:-20 100 175} RATES=${RATES-100} SEEDS=0 VLLM_RATES= WHEELS=/tmp/no-second-install \
  PYTHONPATH=/tmp/site:$PWD bash bench/tts_bench/run_q3tts.sh
log "live text in-process"
PYTHONPATH=/tmp/site:$PWD timeout ${LIVE_S:-200} python3 bench/live_text.py --model /tmp/ckpt/1.7B-CustomVoice --device cuda \
  --runs 3 --sessions ${LIVE_SESSIONS:-1 64} --out "$OUT/live-text-h200.json" 2>&1 | tail -20
if [ "${GPU_TESTS:-1}" = 1 ]; then
  log "GPU tests"
  PYTHONPATH=/tmp/site:$PWD Q3TTS_GPU_TESTS=1 timeout ${GPU_TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu \
    2>&1 | tail -25
fi
log "done"

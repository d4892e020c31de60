#!/usr/bin/env bash
# One device call: live text and sentence cuts at 1 and 64 sessions started together on one engine, the prompts that
# sessions ask for at once built together (TTS.prepare's PromptCombiner) against each built alone (the tree before
# it), in one process (bench/live_text.py --prompts separate combined); the random 1.7B CustomVoice checkpoint, EOS
# off. Carry .gpuwhl (soundfile, soxr and cffi are not on the image).
#   COMMIT=<short hash> OUT=$OUT bash bench/gpu_live_prompts.sh
# Knobs: LIVE_S=300 (the measurement's limit), RUNS=2.
WHEEL_DIRS=.gpuwhl source "$(dirname "$0")/device_call.sh" /tmp/gpu_live_prompts live_prompts.txt
log "checkpoint"
PYTHONPATH=/tmp/site:$PWD python3 bench/tts_bench/build_ckpt.py --out /tmp/ckpt/1.7B-CustomVoice 2>&1 | tail -2
log "live text and sentence cuts, prompts each alone then together"
PYTHONPATH=/tmp/site:$PWD timeout ${LIVE_S:-300} python3 bench/live_text.py --model /tmp/ckpt/1.7B-CustomVoice \
  --device cuda --runs ${RUNS:-2} --sessions 1 64 --intervals 10 100 --prompts separate combined \
  --out "$OUT/live-text-prompts-h200.json" 2>&1
log "done"

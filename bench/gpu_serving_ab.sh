#!/usr/bin/env bash
# One device call: the GPU tests, then 1.7B serving in-process with the engine loop's profile, the base tree
# (carried in .base/: `git archive BASE q3tts bench/serve_load.py | tar -x -C .base`) against this one, in the
# same lease. Carry .benchwhl (the server's wheels), .gpuwhl (pytest, httpx) and .base.
#   BASE_RATES=115,160 RATES=115,160,200 bash bench/gpu_serving_ab.sh        (OUT=$OUT on the device machine)
source "$(dirname "$0")/device_call.sh" /tmp/gpu_serving_ab
RATES=${RATES:-115,160,200} BASE_RATES=${BASE_RATES:-115,160} DURATION=${DURATION:-15}
log "checkpoint"
PYTHONPATH=/tmp/site:$PWD python3 bench/tts_bench/build_ckpt.py --config 1.7B-Base --out /tmp/peer_ckpt/1.7B-Base \
  > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
log "GPU tests"
PYTHONPATH=/tmp/site:$PWD Q3TTS_GPU_TESTS=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu \
  2>&1 | tail -25
for tree in new base; do
  if [ $tree = base ]; then src=.base rates=$BASE_RATES; else src=. rates=$RATES; fi
  log "serving in-process, $tree tree, rates $rates"
  PYTHONPATH=/tmp/site:$src timeout 200 python3 $src/bench/serve_load.py --ckpt-root /tmp/peer_ckpt \
    --sizes 1.7B-Base --rates "$rates" --duration "$DURATION" --max-running 256 --profile-loop \
    --out "$OUT/serving-$tree.json" 2>&1 | grep -v "^\s*$" | cut -c1-600
done
log "done"

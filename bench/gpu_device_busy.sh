#!/usr/bin/env bash
# One device call: how busy the GPU is while 1.7B serving runs in-process at the knee and at capacity
# (bench/serve_load.py --device-trace: the process's CUDA activity over a window of each rate, beside the engine
# loop's profile), with the codec's decode beside the frame (the default) and, at capacity, after it
# (overlap_max_rows 0). Carry .benchwhl (the server's wheels) and .gpuwhl (pytest, httpx).
#   RATES=110,200 bash bench/gpu_device_busy.sh        (OUT=$OUT on the device machine)
source "$(dirname "$0")/device_call.sh" /tmp/gpu_device_busy
RATES=${RATES:-110,200} DURATION=${DURATION:-12} TRACE=${TRACE:-5,1}
export PYTHONPATH=/tmp/site:$PWD
log "checkpoint"
python3 bench/tts_bench/build_ckpt.py --config 1.7B-Base --out /tmp/peer_ckpt/1.7B-Base > "$OUT/build.log" 2>&1 \
  || { tail -5 "$OUT/build.log"; exit 1; }
for overlap in default 0; do
  if [ $overlap = default ]; then rates=$RATES flag=(); else rates=${RATES##*,} flag=(--overlap-max-rows 0); fi
  log "serving in-process, overlap $overlap, rates $rates"
  timeout 200 python3 bench/serve_load.py --ckpt-root /tmp/peer_ckpt --sizes 1.7B-Base --rates "$rates" \
    --duration "$DURATION" --max-running 256 --profile-loop --device-trace "$TRACE" "${flag[@]}" \
    --out "$OUT/serving-overlap-$overlap.json" 2>&1 | grep -v "^\s*$" | cut -c1-400
done
log "done"

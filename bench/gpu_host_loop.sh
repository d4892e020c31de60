#!/usr/bin/env bash
# One device call for issue 46 item 4: 1.7B serving at offered loads up to ~2,000 audio-s/s, in-process with the
# engine loop's profile (host phases beside the waits for the device) and over HTTP through `q3tts serve` (the
# front and one engine process, what it runs on a GPU), then the language model's frame alone at the same rows.
# Carry .benchwhl (the server's wheels) and .gpuwhl (pytest, httpx).
#   RATES=110,150,200 bash bench/gpu_host_loop.sh        (OUT=$OUT on the device machine)
source "$(dirname "$0")/device_call.sh" /tmp/gpu_host_loop
RATES=${RATES:-110,150,200} DURATION=${DURATION:-15}
export PYTHONPATH=/tmp/site:$PWD
git log -1 --format=%h 2>/dev/null || true
log "checkpoint"
python3 bench/tts_bench/build_ckpt.py --config 1.7B-Base --out /tmp/peer_ckpt/1.7B-Base > "$OUT/build.log" 2>&1 \
  || { tail -5 "$OUT/build.log"; exit 1; }
log "serving in-process, rates $RATES"
timeout 230 python3 bench/serve_load.py --ckpt-root /tmp/peer_ckpt --sizes 1.7B-Base --rates "$RATES" \
  --duration "$DURATION" --max-running 256 --profile-loop --out "$OUT/serving-inprocess.json" 2>&1 \
  | grep -v "^\s*$" | cut -c1-900
log "serving over HTTP, rates $RATES"
SKIP_SINGLE=1 timeout 240 bash bench/serve_http_ab.sh /tmp/peer_ckpt/1.7B-Base "$RATES" "$OUT" 2>&1 | cut -c1-900
log "the frame alone"
timeout $(( 590 - ($(date +%s) - T0) )) python3 bench/decode.py --ckpt-root /tmp/peer_ckpt --sizes 1.7B-Base \
  --batches 128,192,256 --breakdown 256 --out "$OUT/decode.json" 2>&1 | grep -v "^\s*$" | tail -30
log "done"

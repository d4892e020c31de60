#!/usr/bin/env bash
# One device call for issue 46 item 4: 1.7B serving at offered loads up to ~2,000 audio-s/s, in-process with the
# engine loop's profile (host phases beside the waits for the device) and over HTTP through `q3tts serve` (the
# front and one engine process, what it runs on a GPU), then the language model's frame alone at the same rows.
# Carry .benchwhl (the server's wheels) and .gpuwhl (pytest, httpx).
#   RATES=110,150,200 bash bench/gpu_host_loop.sh        (OUT=$OUT on the device machine)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_host_loop}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
RATES=${RATES:-110,150,200} DURATION=${DURATION:-15}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .benchwhl/*.whl .gpuwhl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
lscpu | grep "Model name"
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

#!/usr/bin/env bash
# Serving over HTTP, one process against a front and an engine process, on one machine in one run (perf-notes 65).
# On a GPU machine: the front is what `q3tts serve` runs there (on the CPU both layouts are one process).
#   bash bench/serve_http_ab.sh CHECKPOINT RATES [OUTDIR]      e.g. /tmp/peer_ckpt/1.7B-Base 90,115,130
# The checkpoint: random weights at the real config with EOS off, e.g. the peer harness's
#   python3 shared/bench/peers/peer_bench.py build --config 1.7B-Base --out /tmp/peer_ckpt/1.7B-Base
# Each layout: `q3tts serve CHECKPOINT --max-running 256` until /ready, then bench/serve_load.py --http with 4 load
# processes at each rate for 15 s; results in OUTDIR/http_single.json and OUTDIR/http_front.json (SKIP_SINGLE=1:
# the front layout only, what `q3tts serve` runs on a GPU).
set -u
CKPT=$1 RATES=$2 OUT=${3:-/tmp/serve_http_ab}
mkdir -p "$OUT"
run_one() {  # name, port, serve flags...
  local name=$1 port=$2; shift 2
  python3 -m q3tts.cli serve "$CKPT" --port "$port" --max-running 256 --log-level warning "$@" \
    > "$OUT/server_$name.txt" 2>&1 &
  local pid=$! t0=$(date +%s)
  until curl -s -o /dev/null -w "%{http_code}" "localhost:$port/ready" | grep -q 200; do
    sleep 1
    if ! kill -0 $pid 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt 300 ]; then
      echo "$name did not start"; tail -20 "$OUT/server_$name.txt"; return
    fi
  done
  echo "$name ready in $(( $(date +%s) - t0 )) s"
  python3 bench/serve_load.py --http "http://127.0.0.1:$port" --rates "$RATES" --duration 15 --clients 4 \
    --out "$OUT/http_$name.json" 2>&1 | grep -v "^\s*$"
  kill -TERM $pid; wait $pid 2>/dev/null
}
[ -n "${SKIP_SINGLE:-}" ] || run_one single 8100 --single-process
run_one front 8101

#!/usr/bin/env bash
# tts-bench (nari-labs/benchmarks, the real `bench run` CLI) against `q3tts serve` on one GPU, in one device call:
# wheels installed, the random 1.7B CustomVoice checkpoint built (EOS off), the server started (front + engine
# process, as on a GPU) until /ready, then ladders of request rates, three seeds per rate, until p95 TTFA
# passes GATE_MS or underruns appear, and the run files turned into one bench/results file.
#   COMMIT=$(git rev-parse --short HEAD) bash bench/tts_bench/run_q3tts.sh          (device call, carry .benchwhl)
# Everything goes to $OUT (log.txt, env.json, tts-bench-q3tts.json, runs.tar.xz, server.log). Knobs (env):
#   RATES="20 100 160 220 280 340"  HTTP --target nari ladder      SEEDS="0 1 2"
#   VLLM_RATES="20 220"  VLLM_SEEDS="0"   HTTP --target vllm-omni (same server; only stream_format differs)
#   WS=0  WS_RATES="20 100 160"  WS_SEEDS="0"   --transport websocket --target nari (live text), WS=1 to run
#   WARMUP=3s DURATION=10s  MAX_NEW_TOKENS=51 (50 frames = 4.0 s of audio each; EOS never comes)
#   PER_CLIENT=60: above this many requests/s a rate is split over ceil(rps/PER_CLIENT) bench processes
#   (distinct seeds, pooled by to_results.py), since one asyncio client process saturates a core
#   GATE_MS=50  DEADLINE=540 (s from the start; a seed that would end later is skipped, logged)
#   CKPT=/tmp/ckpt/1.7B-CustomVoice (built unless it exists)  MODEL_ARG (serve's model: default CKPT; `tiny` in
#   a CPU dry run)  SERVE_FLAGS="--max-running 256"  WHEELS=.benchwhl (none installed if the folder is absent)
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-/tmp/tts_bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
PY=${PY:-python3}
PYB=${PYB:-$PY}  # the python that runs tts-bench (3.12+): the same one on the GPU machine
WHEELS=${WHEELS:-.benchwhl}
RUNS=${RUNS:-/dev/shm/tts_bench_runs}  # tmpfs: tts-bench fsyncs every request's files
CKPT=${CKPT:-/tmp/ckpt/1.7B-CustomVoice}
MODEL_ARG=${MODEL_ARG:-$CKPT}
SERVED=${SERVED:-Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice}
PORT=${PORT:-8000}
RATES=${RATES:-20 100 160 220 280 340}
SEEDS=${SEEDS:-0 1 2}
VLLM_RATES=${VLLM_RATES:-20 220}
VLLM_SEEDS=${VLLM_SEEDS:-0}
WS=${WS:-0}
WS_RATES=${WS_RATES:-20 100 160}
WS_SEEDS=${WS_SEEDS:-0}
WARMUP=${WARMUP:-3s}
DURATION=${DURATION:-10s}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-51}
PER_CLIENT=${PER_CLIENT:-60}
GATE_MS=${GATE_MS:-50}
DEADLINE=${DEADLINE:-540}
SERVE_FLAGS=${SERVE_FLAGS:---max-running 256}
DATASET=${DATASET:-bench/tts_bench/prompts-en.jsonl}
ENGINE=${ENGINE:-q3tts}
export PYTHONUNBUFFERED=1
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
secs() { local v=${1%s}; echo "${v%.*}"; }

if [ -d "$WHEELS" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
log "wheels in; tts-bench $($PYB -m tts_bench --version 2>&1)"
rm -rf "$RUNS"; mkdir -p "$RUNS"

$PY - "$OUT/env.json" <<'EOF'
import json, os, platform, subprocess, sys, datetime
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {e}"
card = sh("nvidia-smi --query-gpu=name --format=csv,noheader") or "cpu"
env = {"card": card.splitlines()[0] if card else "cpu", "date": datetime.datetime.now(datetime.timezone.utc)
       .strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": os.environ.get("COMMIT") or sh("git rev-parse --short HEAD")
       or None, "host_cpu": sh("lscpu | grep 'Model name' | head -1"), "cores": os.cpu_count(),
       "python": sys.version.split()[0], "nvidia_smi": sh("nvidia-smi --query-gpu=driver_version,clocks.sm,"
       "clocks.max.sm,memory.total --format=csv"),
       "packages": sh(f"{sys.executable} -m pip list 2>/dev/null | grep -i -E "
                      "'^(torch|triton|transformers|aiohttp|fastapi|uvicorn|pydantic|tts-bench) '"),
       "knobs": {k: os.environ.get(k) for k in ("RATES", "SEEDS", "VLLM_RATES", "WS", "WS_RATES", "WARMUP",
                 "DURATION", "MAX_NEW_TOKENS", "PER_CLIENT", "GATE_MS", "SERVE_FLAGS")}}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: env[k] for k in ("card", "commit", "cores", "python")}))
EOF

if [ "$MODEL_ARG" = "$CKPT" ] && [ ! -f "$CKPT/model.safetensors" ]; then
  log "building $CKPT"
  $PY bench/tts_bench/build_ckpt.py --out "$CKPT" ${HUB_CACHE:+--hub-cache "$HUB_CACHE"} || { log "build failed"; exit 1; }
fi

start_server() {
  log "q3tts serve $MODEL_ARG $SERVE_FLAGS"
  $PY -m q3tts.cli serve "$MODEL_ARG" --port "$PORT" --served-model-name "$SERVED" --log-level warning \
    $SERVE_FLAGS > "$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  local t=$(date +%s)
  until curl -s -o /dev/null -w "%{http_code}" "localhost:$PORT/ready" | grep -q 200; do
    sleep 1
    if ! kill -0 $SERVER_PID 2>/dev/null || [ $(( $(date +%s) - t )) -gt 400 ]; then
      log "server did not start"; tail -30 "$OUT/server.log"; return 1
    fi
  done
  log "server ready in $(( $(date +%s) - t )) s"
}

# one seed of one rate: ceil(rps / PER_CLIENT) bench processes at rps / K each, seeds seed*100 + k
run_seed() {  # target transport rps seed
  local target=$1 transport=$2 rps=$3 seed=$4
  local k=$(( (rps + PER_CLIENT - 1) / PER_CLIENT )); [ $k -lt 1 ] && k=1
  local group="${ENGINE}_${transport}_${target}_r${rps}_s${seed}"
  local need=$(( $(secs "$WARMUP") + $(secs "$DURATION") + 12 ))
  if [ $(( $(date +%s) - T0 + need )) -gt "$DEADLINE" ]; then
    log "SKIPPED $group: would end past DEADLINE=${DEADLINE}s"; return 2
  fi
  local share; share=$($PY -c "print(round($rps / $k, 6))")
  local pids=() c
  for c in $(seq 0 $(( k - 1 ))); do
    $PYB -m tts_bench run --target "$target" --transport "$transport" --base-url "http://127.0.0.1:$PORT" \
      --dataset "$DATASET" --rps "$share" --warmup "$WARMUP" --duration "$DURATION" --seed $(( seed * 100 + c )) \
      --timeout 120s --max-in-flight 4096 --request-param "max_new_tokens=$MAX_NEW_TOKENS" \
      --output "$RUNS/$group/c$c" > "$RUNS/$group.c$c.txt" 2>&1 &
    pids+=($!)
  done
  local rc=0 p
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for c in $(seq 0 $(( k - 1 ))); do
    [ -d "$RUNS/$group/c$c" ] || continue
    rm -rf "$RUNS/$group/c$c/audio"
    printf '{"engine": "%s", "model": "1.7B-CustomVoice", "group": "%s", "rps": %s, "seed": %s, "clients": %s, "max_new_tokens": %s}\n' \
      "$ENGINE" "$group" "$rps" "$seed" "$k" "$MAX_NEW_TOKENS" > "$RUNS/$group/c$c/q3tts-run.json"
  done
  if [ $rc -ne 0 ]; then log "FAILED $group"; tail -5 "$RUNS/$group".c*.txt; return 1; fi
  grep -h -E "^Actual RPS|First playable|Audible TTFA|^  E2E|underrun requests|received audio" "$RUNS/$group.c0.txt" \
    | sed "s/^/  $group c0: /"
}

gate() {  # target transport rps: 0 = within GATE_MS and no underruns
  $PYB bench/tts_bench/to_results.py "$RUNS" --out /tmp/gate.json --gate "$ENGINE/$2/$1/$3" --gate-ms "$GATE_MS"
}

ladder() {  # target transport "rates" "seeds"
  local target=$1 transport=$2 rps seed
  for rps in $3; do
    for seed in $4; do run_seed "$target" "$transport" "$rps" "$seed" || break; done
    gate "$target" "$transport" "$rps" || { log "ladder $transport/$target stops at $rps rps"; break; }
  done
}

start_server || exit 1
log "throwaway warm-up run (first requests after start)"
$PYB -m tts_bench run --target nari --base-url "http://127.0.0.1:$PORT" --dataset "$DATASET" --rps "${WARMUP_RPS:-20}" --warmup 0s \
  --duration 3s --request-param "max_new_tokens=$MAX_NEW_TOKENS" --output "$RUNS/warmup" 2>&1 | grep -E "successful|First playable"
rm -rf "$RUNS/warmup"

log "ladder http/nari: $RATES"
ladder nari http "$RATES" "$SEEDS"
log "ladder http/vllm-omni: $VLLM_RATES"
ladder vllm-omni http "$VLLM_RATES" "$VLLM_SEEDS"
if [ "$WS" = 1 ]; then
  log "ladder websocket/nari: $WS_RATES"
  ladder nari websocket "$WS_RATES" "$WS_SEEDS"
fi
kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null

$PYB bench/tts_bench/to_results.py "$RUNS" --out "$OUT/tts-bench-$ENGINE.json" --env "$OUT/env.json" \
  --command "bench/tts_bench/run_q3tts.sh (tts-bench $($PYB -m tts_bench --version 2>&1 | awk '{print $3}'))"
(cd "$RUNS" && find . -name '*.txt' -o -name summary.json -o -name run.json -o -name q3tts-run.json \
  -o -name report.txt -o -name status.json -o -name requests.jsonl | tar -cJf "$OUT/runs.tar.xz" -T -)
if [ "$(stat -c %s "$OUT/runs.tar.xz")" -gt 15000000 ]; then  # keep under the 16 MiB a file that comes back
  (cd "$RUNS" && find . -name '*.txt' -o -name summary.json -o -name run.json -o -name q3tts-run.json \
    -o -name report.txt | tar -cJf "$OUT/runs.tar.xz" -T -)
fi
tail -c 8000000 "$OUT/server.log" > "$OUT/server.log.tail" && mv "$OUT/server.log.tail" "$OUT/server.log"
log "done; files: $(ls "$OUT" | tr '\n' ' ')"

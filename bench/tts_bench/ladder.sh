# Shared by run_q3tts.sh and run_nari.sh (sourced, not run): the knobs, the wheels, the checkpoint, and the
# tts-bench ladder. Knobs (environment):
#   RATES  SEEDS="0 1 2"            HTTP --target nari ladder (each engine's script sets its RATES)
#   VLLM_RATES  VLLM_SEEDS="0"      HTTP --target vllm-omni (same server; only stream_format=audio differs)
#   WS=0  WS_RATES  WS_SEEDS="0"    --transport websocket --target nari (live text); WS=1 runs it
#   WARMUP=3s DURATION=10s          per run (seconds, with the s)
#   MAX_NEW_TOKENS=51               50 frames = 4.0 s of audio each (EOS never comes; max_new_tokens - 1 frames)
#   PER_CLIENT=60                   above this many requests/s a rate is split over ceil(rps/PER_CLIENT) bench
#                                   processes (seeds seed*100+k), pooled by to_results.py: one asyncio client
#                                   process saturates its core (client_cost.py); a huge value = one process
#   GATE_MS=50                      a ladder stops after the first rate whose median p95 TTFA passes it, or that
#                                   had an underrun or a failed request
#   NO_GATE=0                       1: every rate runs (a diagnosis past the knee)
#   ON_RATE                         a command run (in the background if it should be) before each rate, given
#                                   the transport and the rate: e.g. bench/profilers/server_threads.sh
#   DEADLINE=540                    seconds from the start; a seed that would end later is skipped and logged
#   CKPT=/tmp/ckpt/1.7B-CustomVoice built unless it exists   COMMIT  the measured tree's commit, for the results
#   OUT=/tmp/tts_bench_out          log.txt, env.json, tts-bench-ENGINE.json, runs.tar.xz, server.log
set -uo pipefail
T0=${T0:-$(date +%s)}
OUT=${OUT:-/tmp/tts_bench_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PY=${PY:-python3}
PYB=${PYB:-$PY}  # the python that runs tts-bench (3.12+): the same one on the GPU machine
if [ -w /dev/shm ]; then RUNS=${RUNS:-/dev/shm/tts_bench_runs}; else RUNS=${RUNS:-/tmp/tts_bench_runs}; fi
# (tmpfs: tts-bench fsyncs three files per request, and writes each one's audio twice)
CKPT=${CKPT:-/tmp/ckpt/1.7B-CustomVoice}
SERVED=${SERVED:-Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice}
PORT=${PORT:-8000}
SEEDS=${SEEDS:-0 1 2}
VLLM_SEEDS=${VLLM_SEEDS:-0}
WS=${WS:-0}
WS_SEEDS=${WS_SEEDS:-0}
WARMUP=${WARMUP:-3s}
DURATION=${DURATION:-10s}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-51}
PER_CLIENT=${PER_CLIENT:-60}
GATE_MS=${GATE_MS:-50}
DEADLINE=${DEADLINE:-540}
DATASET=${DATASET:-bench/tts_bench/prompts-en.jsonl}
export PYTHONUNBUFFERED=1
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
secs() { local v=${1%s}; echo "${v%.*}"; }

install_wheels() {  # folder target: pip --no-deps into target, put first on PYTHONPATH (with the repo)
  if [ -d "$1" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" "$1"/*.whl \
      || { log "wheel install from $1 failed"; exit 1; }
    export PYTHONPATH=$2:$REPO${PYTHONPATH:+:$PYTHONPATH}
  else
    log "no $1: nothing installed"
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
  fi
  log "tts-bench: $($PYB -m tts_bench --version 2>&1)"
  rm -rf "$RUNS"; mkdir -p "$RUNS"
}

write_env() {
  $PY - "$OUT/env.json" <<'EOF'
import datetime, json, os, subprocess, sys
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {e}"
card = sh("nvidia-smi --query-gpu=name --format=csv,noheader") or "cpu"
env = {"card": card.splitlines()[0], "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
       "commit": os.environ.get("COMMIT") or sh("git rev-parse --short HEAD 2>/dev/null") or None,
       "engine": os.environ.get("ENGINE"), "host_cpu": sh("lscpu | grep 'Model name' | head -1"),
       "cores": os.cpu_count(), "python": sys.version.split()[0],
       "nvidia_smi": sh("nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv"),
       "packages": sh(f"{sys.executable} -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|aiohttp|"
                      "fastapi|uvicorn|pydantic|tts-bench|flashinfer-python|nari-qwen3-tts) '"),
       "knobs": {k: os.environ.get(k) for k in ("RATES", "SEEDS", "VLLM_RATES", "WS", "WS_RATES", "WARMUP",
                 "DURATION", "MAX_NEW_TOKENS", "PER_CLIENT", "GATE_MS", "SERVE_FLAGS", "NARI_PROFILE")}}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: env[k] for k in ("card", "commit", "cores", "python")}))
EOF
}

build_ckpt() {  # [--hub-cache DIR]
  if [ ! -f "$CKPT/model.safetensors" ]; then
    log "building $CKPT"
    $PY bench/tts_bench/build_ckpt.py --out "$CKPT" "$@" || { log "checkpoint build failed"; exit 1; }
  fi
}

wait_ready() {  # pid limit_s: until /ready answers 200
  local t=$(date +%s)
  until curl -s -o /dev/null -w "%{http_code}" "localhost:$PORT/ready" | grep -q 200; do
    sleep 1
    if ! kill -0 "$1" 2>/dev/null || [ $(( $(date +%s) - t )) -gt "$2" ]; then
      log "server did not start"; tail -40 "$OUT/server.log"; return 1
    fi
  done
  log "server ready in $(( $(date +%s) - t )) s"
}

warm_up() {  # a throwaway run: the first requests after start
  log "throwaway warm-up run"
  $PYB -m tts_bench run --target nari --base-url "http://127.0.0.1:$PORT" --dataset "$DATASET" \
    --rps "${WARMUP_RPS:-20}" --warmup 0s --duration 3s --request-param "max_new_tokens=$MAX_NEW_TOKENS" \
    --output "$RUNS/warmup" 2>&1 | grep -E "successful|First playable|Error"
  rm -rf "$RUNS/warmup"
}

run_seed() {  # target transport rps seed: ceil(rps/PER_CLIENT) bench processes at rps/K each
  local target=$1 transport=$2 rps=$3 seed=$4
  local k=$(( (${rps%.*} + PER_CLIENT - 1) / PER_CLIENT )); [ $k -lt 1 ] && k=1
  local group="${ENGINE}_${transport}_${target}_r${rps}_s${seed}"
  local need=$(( $(secs "$WARMUP") + $(secs "$DURATION") + 12 ))
  if [ $(( $(date +%s) - T0 + need )) -gt "$DEADLINE" ]; then
    log "SKIPPED $group: would end past DEADLINE=${DEADLINE}s"; return 2
  fi
  local share pids=() c rc=0 p
  share=$($PY -c "print(round($rps / $k, 6))")
  for c in $(seq 0 $(( k - 1 ))); do
    $PYB -m tts_bench run --target "$target" --transport "$transport" --base-url "http://127.0.0.1:$PORT" \
      --dataset "$DATASET" --rps "$share" --warmup "$WARMUP" --duration "$DURATION" --seed $(( seed * 100 + c )) \
      --timeout 120s --max-in-flight 4096 --request-param "max_new_tokens=$MAX_NEW_TOKENS" \
      --output "$RUNS/$group/c$c" > "$RUNS/$group.c$c.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for c in $(seq 0 $(( k - 1 ))); do
    [ -d "$RUNS/$group/c$c" ] || continue
    rm -rf "$RUNS/$group/c$c/audio" "$RUNS/$group/c$c/events.jsonl"  # GBs at hundreds of requests/s; unused
    printf '{"engine": "%s", "model": "1.7B-CustomVoice", "group": "%s", "rps": %s, "seed": %s, "clients": %s, "max_new_tokens": %s}\n' \
      "$ENGINE" "$group" "$rps" "$seed" "$k" "$MAX_NEW_TOKENS" > "$RUNS/$group/c$c/q3tts-run.json"
  done
  if [ $rc -ne 0 ]; then log "FAILED $group"; tail -5 "$RUNS/$group".c*.txt; return 1; fi
  grep -h -E "^Actual RPS|First playable|Audible TTFA|^  E2E|underrun requests|  successful|received audio" \
    "$RUNS/$group.c0.txt" | sed "s/^/  $group c0 of $k: /"
}

gate() {  # target transport rps: 0 = within GATE_MS, no underrun, no failure
  $PYB bench/tts_bench/to_results.py "$RUNS" --out /tmp/gate.json --gate "$ENGINE/$2/$1/$3" --gate-ms "$GATE_MS"
}

ladder() {  # target transport "rates" "seeds"
  local target=$1 transport=$2 rps seed
  [ -n "$3" ] || return 0
  log "ladder $transport/$target: $3 (seeds $4)"
  for rps in $3; do
    [ -n "${ON_RATE:-}" ] && $ON_RATE "$transport" "$rps"
    for seed in $4; do run_seed "$target" "$transport" "$rps" "$seed" || break; done
    gate "$target" "$transport" "$rps" || [ "${NO_GATE:-0}" = 1 ] \
      || { log "ladder $transport/$target stops at $rps rps"; break; }
  done
}

finish() {  # the results file and a small archive of tts-bench's own files
  $PYB bench/tts_bench/to_results.py "$RUNS" --out "$OUT/tts-bench-$ENGINE.json" --env "$OUT/env.json" \
    --command "$1 (tts-bench $($PYB -W ignore -m tts_bench --version 2>/dev/null | awk '{print $3}'))"
  local keep=(-name '*.txt' -o -name summary.json -o -name run.json -o -name q3tts-run.json -o -name report.txt
              -o -name status.json)
  local pack="xz -T0 -3" ext=xz
  command -v xz > /dev/null || { pack="gzip -6"; ext=gz; }
  (cd "$RUNS" && find . "${keep[@]}" -o -name requests.jsonl | tar -c -T - | $pack > "$OUT/runs.tar.$ext")
  if [ "$(stat -c %s "$OUT/runs.tar.$ext")" -gt 15000000 ]; then  # a file that comes back: at most 16 MiB
    (cd "$RUNS" && find . "${keep[@]}" | tar -c -T - | $pack > "$OUT/runs.tar.$ext")
  fi
  if [ -f "$OUT/server.log" ]; then
    tail -c 8000000 "$OUT/server.log" > "$OUT/server.log.tail" && mv "$OUT/server.log.tail" "$OUT/server.log"
  fi
  log "done; files: $(ls "$OUT" | tr '\n' ' ')"
}

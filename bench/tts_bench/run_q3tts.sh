#!/usr/bin/env bash
# tts-bench (nari-labs/benchmarks, the real `bench run` CLI) against `q3tts serve` on one GPU, in one device call:
# the wheels of .benchwhl installed, the random 1.7B CustomVoice checkpoint built (EOS off), the server started
# (front + engine process, as on a GPU) until /ready, then ladders of request rates, three seeds per rate, until
# p95 TTFA passes GATE_MS or underruns appear, and the run files turned into one bench/results file in $OUT.
#   COMMIT=<short hash> bash bench/tts_bench/run_q3tts.sh          (device call; carry .benchwhl)
# Knobs: ladder.sh's, and RATES="20 100 175 225 275 325" VLLM_RATES="20 225" WS_RATES="20 100 175" (an empty
# list skips that ladder), SERVE_FLAGS="--max-running 256", MODEL_ARG (serve's model: the checkpoint; `tiny` in a CPU dry run),
# WHEELS=.benchwhl.
source "$(dirname "$0")/ladder.sh"
ENGINE=q3tts
RATES=${RATES-20 100 175 225 275 325}
VLLM_RATES=${VLLM_RATES-20 225}
WS_RATES=${WS_RATES-20 100 175}
SERVE_FLAGS=${SERVE_FLAGS:---max-running 256}
MODEL_ARG=${MODEL_ARG:-$CKPT}
export ENGINE RATES VLLM_RATES WS_RATES SERVE_FLAGS

install_wheels "${WHEELS:-.benchwhl}" /tmp/site
write_env
[ "$MODEL_ARG" = "$CKPT" ] && build_ckpt
log "q3tts serve $MODEL_ARG $SERVE_FLAGS"
$PY -m q3tts.cli serve "$MODEL_ARG" --port "$PORT" --served-model-name "$SERVED" --log-level warning $SERVE_FLAGS \
  > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
wait_ready $SERVER_PID 400 || exit 1
warm_up
ladder nari http "$RATES" "$SEEDS"
ladder vllm-omni http "$VLLM_RATES" "$VLLM_SEEDS"
[ "$WS" = 1 ] && ladder nari websocket "$WS_RATES" "$WS_SEEDS"
kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null
finish bench/tts_bench/run_q3tts.sh

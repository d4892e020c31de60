#!/usr/bin/env bash
# tts-bench against nari-qwen3-tts (nari-labs/nari-qwen3-tts) on one GPU, in one device call, on the same random
# 1.7B CustomVoice checkpoint as run_q3tts.sh: the wheels of .nariwhl (fetch_nari_wheels.sh) installed, the
# checkpoint built and laid out as a hub cache entry at nari's pinned revision (so `--local-files-only` finds it
# and the served model id is the official one tts-bench sends), nari's FlashInfer kernels compiled ahead in
# parallel from the start (nari_launch.py prewarm; nari compiles on first use otherwise, and FlashInfer's file
# locks make it wait for a module being built rather than build it twice), nari's server started
# (nari_launch.py serve: the H100-only name check dropped) until /ready, then the ladder.
#   COMMIT=<short hash> bash bench/tts_bench/run_nari.sh          (device call; carry .nariwhl)
# Knobs: ladder.sh's, and RATES="5 10 15 20 30" (nari's published H100 table: p95 TTFA 34 ms at 10, 77 ms at 20
# requests/s), NARI_PROFILE=ttfa (nari-qwen3-tts-server's default; `balanced` is its container's),
# NARI_FLAGS (more nari-qwen3-tts-server flags), READY_S=480 (its start: JIT builds, CUDA graph capture).
source "$(dirname "$0")/ladder.sh"
ENGINE=nari-qwen3-tts
RATES=${RATES-5 10 15 20 30}
VLLM_RATES=${VLLM_RATES-}
WS_RATES=${WS_RATES-5 10}
NARI_PROFILE=${NARI_PROFILE:-ttfa}
HUB_CACHE=${HUB_CACHE:-/tmp/hfcache}
export ENGINE RATES VLLM_RATES WS_RATES NARI_PROFILE
# FlashInfer's JIT runs `ninja` and nvcc: python3's own bin folder (pip's ninja) and CUDA's on the PATH. MAX_JOBS
# per building process (the prewarm runs four at once: 4 x 6 nvcc jobs, ~2 GB each, on 16 cores and 128 GiB).
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-6}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PATH="$(dirname "$($PY -c 'import sys; print(sys.executable)')"):$PATH"
[ -d /usr/local/cuda/bin ] && PATH="$PATH:/usr/local/cuda/bin"
export PATH
log "ninja: $(command -v ninja || echo MISSING), nvcc: $(command -v nvcc || echo MISSING) $(nvcc --version 2>/dev/null | tail -1)"

install_wheels "${WHEELS:-.nariwhl}" /tmp/nsite
write_env
$PY bench/tts_bench/nari_launch.py prewarm > "$OUT/prewarm.log" 2>&1 &
PREWARM_PID=$!
build_ckpt --hub-cache "$HUB_CACHE"
[ -d "$HUB_CACHE/models--Qwen--Qwen3-TTS-12Hz-1.7B-CustomVoice" ] \
  || PYTHONPATH="bench/tts_bench${PYTHONPATH:+:$PYTHONPATH}" $PY -c "from pathlib import Path; import build_ckpt; \
print(build_ckpt.link_hub_cache(Path('$CKPT'), Path('$HUB_CACHE')))"
log "nari-qwen3-tts-server --profile $NARI_PROFILE ${NARI_FLAGS:-}"
$PY bench/tts_bench/nari_launch.py serve --model "$SERVED" --model-cache-dir "$HUB_CACHE" --local-files-only \
  --device cuda:0 --profile "$NARI_PROFILE" --host 127.0.0.1 --port "$PORT" ${NARI_FLAGS:-} > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
wait_ready $SERVER_PID "${READY_S:-480}" || { finish bench/tts_bench/run_nari.sh; exit 1; }
wait $PREWARM_PID; log "prewarm (FlashInfer's file locks let nari wait for a module being built): $(grep prewarm \
  "$OUT/prewarm.log" | tr '\n' ' ' | cut -c1-600)"
warm_up
ladder nari http "$RATES" "$SEEDS"
[ -n "$VLLM_RATES" ] && ladder vllm-omni http "$VLLM_RATES" "$VLLM_SEEDS"
[ "$WS" = 1 ] && ladder nari websocket "$WS_RATES" "$WS_SEEDS"
kill -TERM $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null
finish bench/tts_bench/run_nari.sh

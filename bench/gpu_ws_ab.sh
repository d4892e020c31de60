#!/usr/bin/env bash
# One device call: tts-bench's live-text WebSocket ladder (nari.speech.v1, one word every 10 ms, each acknowledged)
# against `q3tts serve` (a front and one engine process, as on a GPU) for this tree, then for a base tree, one seed a
# rate and every rate run (NO_GATE), so that the knee of both is measured in the same call on the same card.
# The base tree travels as its q3tts package and tts-bench scripts in .wsbase (git-ignored; made by
# `mkdir .wsbase && git archive BASE q3tts bench/tts_bench | tar -x -C .wsbase`), and runs from there (the scripts
# put their own tree first on the path); carry .benchwhl, .gpuwhl and .wsbase.
#   BASE=<commit> NEW=<commit> OUT=$OUT bash bench/gpu_ws_ab.sh        (WS_RATES="40 70 100" by default)
source "$(dirname "$0")/device_call.sh" /tmp/gpu_ws_ab call.txt
RATES_WS=${WS_RATES:-40 70 100}
for tree in new base; do
  if [ $tree = new ]; then src=$PWD commit=${NEW:-}; else src=$PWD/.wsbase commit=${BASE:-}; fi
  log "tree $tree ($commit): WebSocket ladder $RATES_WS"
  OUT_TREE="$OUT/$tree"
  (cd "$src" && OUT=$OUT_TREE COMMIT=$commit WS=1 WS_RATES="$RATES_WS" WS_SEEDS=0 RATES= VLLM_RATES= NO_GATE=1 \
    DEADLINE=560 WHEELS=/tmp/no-second-install PYTHONPATH=/tmp/site bash bench/tts_bench/run_q3tts.sh 2>&1 \
    | grep -v "^\s*$" | cut -c1-400)
  cp "$OUT_TREE/tts-bench-q3tts.json" "$OUT/tts-bench-ws-$tree.json" 2>/dev/null \
    || tail -30 "$OUT_TREE/server.log"
  rm -rf "$OUT_TREE"  # (the device tool brings back 8 files: the two results and this log)
done
log "done"

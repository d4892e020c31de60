#!/usr/bin/env bash
# One device call: decode speed and first audio beside faster-qwen3-tts 0.5.4 measured in the same call, on the
# checkpoints its harness builds (random weights at the real configs, EOS off: /work/shared/bench/peers/README.md).
# faster-qwen3-tts first (x-vector clones, whole and streamed audio, both sizes), then `q3tts bench decode` at 1 to
# 256 rows and `q3tts bench streaming` for 1.7B with the peer's rows beside. Carry .whl and .peers (the harness,
# copied from shared/bench/peers; the README there lists the wheels).
#   OUT=$OUT bash bench/gpu_decode_peers.sh
WHEEL_DIRS=.whl source "$(dirname "$0")/device_call.sh" /tmp/gpu_decode_peers call.txt
export PYTHONPATH=/tmp/site:$PWD
git log -1 --format=%h 2>/dev/null || true
left() { echo $(( 585 - ($(date +%s) - T0) )); }
log "faster-qwen3-tts"
bash .peers/run_device.sh --engines faster --modes xvec --keep-ckpt --ckpt-root /tmp/peer_ckpt --n-long 200 \
  --n-short 50 --reps 2 --deadline-s 230 | tail -20
rm -f "$OUT/nvidia-smi.txt" "$OUT"/build_*.json  # (the card is named above; the device tool brings back 8 files)
python3 .peers/peer_bench.py export --inputs "$OUT"/peer_*.json --out "$OUT/peers.json" \
  --command "bash .peers/run_device.sh --engines faster --modes xvec --keep-ckpt --ckpt-root /tmp/peer_ckpt --n-long 200 --n-short 50 --reps 2"
log "q3tts decode"
timeout $(( $(left) - 100 )) python3 bench/decode.py --sizes 0.6B-Base,1.7B-Base --batches 1,64,128,256 \
  --breakdown 64 --n-short 30 --n-long 130 --reps 2 --ckpt-root /tmp/peer_ckpt --peer-results "$OUT/peers.json" \
  --out "$OUT/decode.json" 2>&1 | grep -v "^\s*$" | tail -25
log "q3tts streaming"
timeout "$(left)" python3 -m q3tts.cli bench streaming --sizes 1.7B-Base --reps 3 --ckpt-root /tmp/peer_ckpt \
  --peer-results "$OUT/peer_1.7B-Base.json" --out "$OUT/streaming.json" 2>&1 | grep -v "^\s*$"
log "done"

#!/usr/bin/env bash
# Wheels for running nari-qwen3-tts (nari-labs/nari-qwen3-tts) beside tts-bench on the GPU machine (Python 3.12,
# torch 2.11 / triton 3.6 / transformers 5.17 there, no network). nari pins torch 2.13, triton 3.7.1 and
# transformers 4.57.3: torch and triton cannot travel (GBs) and run as the machine has them; transformers 4.57.3
# travels with the tokenizers and huggingface-hub it needs (the machine's 0.23.2 and 1.33 are outside its
# ranges), shadowing 5.17 for nari's process only (its own --target folder). Also: flashinfer-python (JIT:
# compiles its kernels with the machine's nvcc at start), apache-tvm-ffi, qwen-tts 0.1.1 (the codec) with
# librosa and sox, nari-qwen3-tts itself (built here from the fetched source), and the tts-bench and server
# wheels of .benchwhl without av (35 MB; q3tts needs it, nari does not), so that one folder carries a nari call.
#   bash bench/tts_bench/fetch_nari_wheels.sh [DIR] [NARI_SRC] [BENCHWHL]    (default .nariwhl, the fetch mirror,
#   .benchwhl: run fetch_wheels.sh first)
set -euo pipefail
DIR=${1:-.nariwhl}
SRC=${2:-/work/.mirror/nari-labs+nari-qwen3-tts/repo}
BENCHWHL=${3:-.benchwhl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
for w in "$BENCHWHL"/*.whl; do
  case "$(basename "$w")" in av-*|prometheus_client-*|python_multipart-*|httptools-*|uvloop-*) ;; *) cp "$w" "$DIR/" ;; esac
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" \
  flashinfer-python==0.6.16.post2 apache-tvm-ffi==0.1.13.post3 transformers==4.57.3 tokenizers==0.22.2 \
  huggingface-hub==0.36.2 qwen-tts==0.1.1 librosa==0.11.0 pooch==1.9.0 platformdirs==4.11.2 decorator==5.3.1 \
  audioread==3.1.0
TMP=$(mktemp -d)
"$PY" -m pip wheel -q --no-deps -w "$DIR" sox==1.5.0  # an sdist only on PyPI
if [ -d "$SRC/src" ]; then cp -r "$SRC" "$TMP/nari"; else mkdir "$TMP/nari"; git -C "$SRC" archive HEAD | tar -x -C "$TMP/nari"; fi
"$PY" -m pip wheel -q --no-deps --ignore-requires-python -w "$DIR" "$TMP/nari"  # pure Python
rm -rf "$TMP"
du -ch "$DIR"/*.whl | sort -h | tail -6

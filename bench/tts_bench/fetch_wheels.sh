#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, manylinux x86_64, no network there), for a tts-bench run against
# `q3tts serve`: tts-bench itself (built here from nari-labs/benchmarks' tts_bench/) with its dependencies, and
# the q3tts server's packages (perf-notes 87). Versions are the ones tested here (the dev .venv and the
# .venv-bench dry run); packages the GPU image already has (KINDS.md: torch, numpy, regex, tokenizers,
# huggingface-hub, safetensors, ...) are left out, except the aiohttp family, whose version there is unknown and
# which travels whole so that one consistent set shadows it.
#   bash bench/tts_bench/fetch_wheels.sh [DIR] [BENCHMARKS_SRC]
# DIR: default .benchwhl (git-ignored); BENCHMARKS_SRC: a checkout of nari-labs/benchmarks (default: the
# fetch tool's mirror, exported from its HEAD). Then list sizes with `du -ch DIR/*.whl`.
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#   --target /tmp/site DIR/*.whl  (bench/tts_bench/run_q3tts.sh does this).
set -euo pipefail
DIR=${1:-.benchwhl}
SRC=${2:-/work/.mirror/nari-labs+benchmarks/repo}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
           --platform manylinux_2_35_x86_64 --platform manylinux_2_5_x86_64)
BENCH=(  # tts-bench 0.1.0's dependencies (its uv.lock: aiohttp, click, jiwer, numpy, pydantic, whisper-normalizer)
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==6.7.1
  propcache==0.5.2 yarl==1.25.1
  jiwer==4.0.0 rapidfuzz==3.14.5
  whisper-normalizer==0.1.15 indic-numtowords==1.1.0 more-itertools==11.1.0 text2num==3.0.2
)
SERVER=(  # q3tts[server] plus soundfile/soxr (q3tts' own dependencies, absent there)
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2
  importlib-metadata==8.7.1 zipp==3.23.0
  uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 idna==3.20 click==8.5.1 uvloop==0.23.0
  httptools==0.9.0 websockets==17.4 prometheus-client==0.26.0 python-multipart==0.0.34 av==18.1.0
  soundfile==0.14.0 soxr==1.1.0 cffi==2.1.1 pycparser==3.12
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DIR" "${BENCH[@]}" "${SERVER[@]}"
# tts-bench: no release on PyPI; built from the repository's source (uv_build backend, fetched by pip).
TMP=$(mktemp -d)
if [ -d "$SRC/tts_bench" ]; then cp -r "$SRC/tts_bench" "$TMP/"; else git -C "$SRC" archive HEAD tts_bench | tar -x -C "$TMP"; fi
"$PY" -m pip wheel -q --no-deps --ignore-requires-python -w "$DIR" "$TMP/tts_bench"  # pure Python
rm -rf "$TMP"
du -ch "$DIR"/*.whl | sort -h | tail -8

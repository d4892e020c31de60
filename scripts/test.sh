#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh clone, then runs ruff and every test.
#   .venv         q3tts with its dev extras on CPU torch 2.13.0
#   .venv-oracle  the official qwen-tts 0.1.1 (transformers 4.57.3), the equivalence oracle, in its own environment
#   .venv-clients the third-party clients tests/clients drives (Pipecat, LiveKit, wyoming-openai, tts-bench), one
#                 environment each: scripts/client_envs.sh
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k codec`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The environments (and the browser) are set up side by side: each is mostly downloads and disk, and on CI's two
# cores this takes ~8 minutes one after the other. Any failure stops the script once all have ended.
main_env() {
  if [ ! -x .venv/bin/python ]; then "$PYTHON" -m venv .venv; fi
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
}

oracle_env() {
  if [ ! -f .venv-oracle/.ready ]; then
    rm -rf .venv-oracle
    "$PYTHON" -m venv .venv-oracle
    .venv-oracle/bin/pip install -q --disable-pip-version-check torch==2.13.0
    .venv-oracle/bin/pip install -q --disable-pip-version-check --no-deps qwen-tts==0.1.1 torchaudio==2.11.0
    .venv-oracle/bin/pip install -q --disable-pip-version-check transformers==4.57.3 accelerate==1.12.0 \
      librosa==0.11.0 soundfile==0.14.0 soxr==1.1.0 sox==1.5.0 onnxruntime einops==0.8.2
    # The index only has a CUDA torchaudio, whose compiled part fails beside CPU torch; qwen_tts imports
    # torchaudio (for its unused 25 Hz tokenizer) and the pure-Python part is enough.
    rm -f .venv-oracle/lib/python3*/site-packages/torchaudio/lib/*.so
    touch .venv-oracle/.ready
  fi
  # peft applies LoRA adapters to the official model (tests/equivalence/test_lora.py; q3tts merges them itself)
  .venv-oracle/bin/python -c 'import peft' 2>/dev/null \
    || .venv-oracle/bin/pip install -q --disable-pip-version-check peft==0.21.2
}

# The playground's browser tests: Debian's Chromium and ChromeDriver (Selenium comes with the dev extras).
browser() {
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null; }
  fi
}

setups=()
for step in main_env oracle_env "bash scripts/client_envs.sh" browser; do
  (set -e; $step) & setups+=("$!:$step")
done
failed=()
for entry in "${setups[@]}"; do wait "${entry%%:*}" || failed+=("${entry#*:}"); done
if [ ${#failed[@]} -gt 0 ]; then echo "scripts/test.sh: set-up failed: ${failed[*]}" >&2; exit 1; fi

.venv/bin/ruff check q3tts tests bench examples scripts
# Screenshots of the browser tests land in test-artifacts/.
# Q3TTS_TEST_TIME_LIMIT: the guard on one test's time (tests/SLOW.md), 90 s of call time on this 2-core machine.
# Q3TTS_TEST_WORKERS: pytest-xdist workers (2: one per core; tests/conftest.py gives each its share of the threads),
# a test file's tests in one worker (--dist loadfile: its module fixtures built once); 0 runs them in this process.
# tests/docs builds the docs site (mkdocs build --strict) and redraws the plots: the dev extras bring the docs extra.
Q3TTS_TEST_TIME_LIMIT=${Q3TTS_TEST_TIME_LIMIT:-90} Q3TTS_REQUIRE_ORACLE=1 Q3TTS_REQUIRE_BROWSER=1 Q3TTS_REQUIRE_CLIENTS=1 Q3TTS_REQUIRE_DOCS=1 Q3TTS_ARTIFACTS="$PWD/test-artifacts" .venv/bin/python -m pytest -q -n "${Q3TTS_TEST_WORKERS:-2}" --dist loadfile "$@"

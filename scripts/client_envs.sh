#!/usr/bin/env bash
# Builds the third-party clients' environments that tests/clients drives, one virtual environment each under
# .venv-clients/ (their pins conflict: wyoming-openai pins openai 3.22.1, Pipecat and LiveKit take 3.57.0, and
# two of them need Python >= 3.12). Each is built once and rebuilt only when its requirements file changes.
#   pipecat    Python 3.11  tests/clients/requirements/pipecat.txt     (pipecat-ai 1.14.0)
#   livekit    Python 3.11  tests/clients/requirements/livekit.txt     (livekit-plugins-openai 1.8.9)
#   wyoming    Python 3.12  tests/clients/requirements/wyoming.txt     (wyoming-openai 0.8.0, wyoming 1.10.2)
#   tts-bench  Python 3.12  tests/clients/requirements/tts-bench.txt   + tests/clients/vendor/tts_bench
# Only PyPI is needed. PYTHON (default python3) and PYTHON312 (default: python3.12, else pyenv's 3.12) choose the
# interpreters; without a Python 3.12 the last two are left out, and the tests that need them say so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ROOT=.venv-clients
REQS=tests/clients/requirements
PIP_FLAGS=(-q --disable-pip-version-check)

find_python312() {
  # pyenv's shims answer `command -v python3.12` and then fail, so each candidate must run
  local root candidate
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for candidate in "${PYTHON312:-}" python3.12 $(find "$root/versions" -maxdepth 3 -path '*/3.12*/bin/python3.12' \
      2>/dev/null | sort -rV); do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"; return
    fi
  done
}

# build NAME PYTHON [LOCAL PACKAGE FOLDER...]: the environment, unless the one there works and was built from the
# same interpreter, requirements and package files.
build() {
  local name=$1 python=$2 env=$ROOT/$1 stamp
  shift 2
  stamp=$({ "$python" --version; cat "$REQS/$name.txt"
            if [ $# -gt 0 ]; then find "$@" -type f -not -path '*/__pycache__/*' | sort | xargs cat; fi
          } | sha256sum | cut -c1-16)
  if [ "$(cat "$env/.ready" 2>/dev/null)" = "$stamp" ] && "$env/bin/python" -c '' 2>/dev/null; then return; fi
  echo "client environment $env ($("$python" --version))"
  rm -rf "$env"
  "$python" -m venv "$env"
  "$env/bin/pip" install "${PIP_FLAGS[@]}" -r "$REQS/$name.txt"
  for extra in "$@"; do "$env/bin/pip" install "${PIP_FLAGS[@]}" --no-deps "$extra"; done
  echo "$stamp" > "$env/.ready"
}

# The environments are built side by side (a build is mostly downloads and disk); any failure fails the script.
builds=()
mkdir -p "$ROOT"
build pipecat "$PYTHON" & builds+=($!)
build livekit "$PYTHON" & builds+=($!)
PY312=$(find_python312)
if [ -n "$PY312" ]; then
  build wyoming "$PY312" & builds+=($!)
  # nari-labs/benchmarks is not on PyPI and GitHub is not reachable from CI: its tts_bench package is vendored at a
  # pinned commit (tests/clients/vendor/tts_bench/VENDORED.md); its files are part of the stamp.
  build tts-bench "$PY312" tests/clients/vendor/tts_bench & builds+=($!)
else
  echo "client_envs: no Python 3.12 (set PYTHON312): wyoming and tts-bench are not built" >&2
fi
failed=0
for pid in "${builds[@]}"; do wait "$pid" || failed=1; done
exit $failed

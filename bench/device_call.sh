# Shared by the one-call GPU scripts (bench/gpu_*.sh; sourced, not run): the call's log under $OUT (everything
# printed is also kept in OUT/LOG_FILE), a `log` with seconds since the call's start, the carried wheels installed
# into /tmp/site (WHEEL_DIRS: default .benchwhl, the server's, and .gpuwhl, pytest and httpx), and the card and host
# named.
#   [WHEEL_DIRS=".whl"] source "$(dirname "$0")/device_call.sh" DEFAULT_OUT [LOG_FILE]   (LOG_FILE: default log.txt)
set -uo pipefail
OUT=${OUT:-$1}
mkdir -p "$OUT"
export OUT T0=${T0:-$(date +%s)}
exec > >(tee -a "$OUT/${2:-log.txt}") 2>&1
log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
wheels=()
declare -A seen  # (a wheel in two of the folders once: pip refuses the same package twice)
for dir in ${WHEEL_DIRS:-.benchwhl .gpuwhl}; do
  for wheel in "$dir"/*.whl; do
    if [ -z "${seen[${wheel##*/}]:-}" ]; then seen[${wheel##*/}]=1; wheels+=("$wheel"); fi
  done
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
lscpu | grep "Model name"

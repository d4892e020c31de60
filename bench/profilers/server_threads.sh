#!/usr/bin/env bash
# Where a running `q3tts serve`'s processes spend their CPU during one load step: each thread's CPU seconds over
# the step (from /proc, every process whose command line has q3tts.cli: the front and its engine processes) and a
# py-spy profile of all of them (raw, one line per stack with its thread; `py-spy` on the PATH, optional).
#   bash bench/profilers/server_threads.sh LABEL [SECONDS]      writes $OUT/threads_LABEL.json, $OUT/spy_LABEL.txt
# As tts-bench's ladder hook (ladder.sh's ON_RATE, called with the transport and the rate):
#   ON_RATE="bash bench/profilers/server_threads.sh --background" (profiles SECONDS=12 from the rate's start)
set -uo pipefail
if [ "${1:-}" = "--background" ]; then shift; bash "$0" "$1_$2" "${SECONDS_PROFILED:-12}" & exit 0; fi
LABEL=$1 SECONDS_PROFILED=${2:-12} OUT=${OUT:-/tmp}
PIDS=$(pgrep -f "q3tts.cli" | tr '\n' ' ')
[ -n "$PIDS" ] || { echo "server_threads: no q3tts.cli process"; exit 1; }
snapshot() {
  python3 - $PIDS <<'PY'
import json, os, sys
tick, out = os.sysconf("SC_CLK_TCK"), {}
for pid in sys.argv[1:]:
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            f = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            out[f"{pid}/{tid}/{name}"] = (int(f[11]) + int(f[12])) / tick
    except FileNotFoundError:
        pass
print(json.dumps(out))
PY
}
BEFORE=$(snapshot)
FIRST=${PIDS%% *}
if command -v py-spy >/dev/null; then
  py-spy record -p "$FIRST" --subprocesses --nonblocking -r 200 -d "$SECONDS_PROFILED" -f raw \
    -o "$OUT/spy_$LABEL.txt" > "$OUT/spy_$LABEL.log" 2>&1 &
fi
sleep "$SECONDS_PROFILED"
AFTER=$(snapshot)
python3 - "$OUT/threads_$LABEL.json" "$SECONDS_PROFILED" "$BEFORE" "$AFTER" <<'PY'
import json, sys
before, after = json.loads(sys.argv[3]), json.loads(sys.argv[4])
busy = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= 0.05}
busy = dict(sorted(busy.items(), key=lambda kv: -kv[1]))
json.dump({"seconds": float(sys.argv[2]), "cpu_s_by_thread": busy}, open(sys.argv[1], "w"), indent=1)
print(f"server_threads {sys.argv[1]}: " + ", ".join(f"{k} {v:.1f}s" for k, v in list(busy.items())[:8]))
PY
wait

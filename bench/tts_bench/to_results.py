"""tts-bench's run folders -> one bench/results JSON file in the shared format (shared/bench/RESULTS.md).

Each run folder is one `bench run` (one rate, one seed) with tts-bench's own files (run.json, summary.json,
requests.jsonl, ...) and a `q3tts-run.json` beside them that the run script writes: the engine, the model, the
max_new_tokens sent, and, when one rate's load was split over several `bench` processes (`clients` > 1, each at
rps / clients with its own seed), the group they belong to. A group's requests are pooled and summarised by
tts-bench's own `derive_summary` (nearest-rank percentiles over all of them, rates and audio summed); a run of
one process is its own summary.json.

One row per (engine, transport, target, rate, seed):
  ttfa_ms_*            tts-bench's "First playable" (first decoded PCM sample - dispatch)
  audible_ttfa_ms_*    its "Audible TTFA" (first sample above -45 dBFS - dispatch), the one its reports cite
  e2e_ms_*             its "E2E" (end of the response - dispatch)
  underrun_requests    requests whose immediate playback ever stalled (any stall, however short)
  audio_s_per_s        its "received audio xRT": audio received in the measurement window / its length
  behind_realtime_share  underrun_requests / requests (the shared format's field)
The rows of a rate over its seeds are summarised in the printed table (medians), as tts-bench's reports do.

    python bench/tts_bench/to_results.py RUNS_ROOT --out bench/results/DATE-tts-bench-h200.json \
        [--env RUNS_ROOT/env.json] [--command "..."]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def load_summary(runs: list[Path]) -> dict[str, Any]:
    """tts-bench's summary of one run, or of a group of runs pooled."""
    if len(runs) == 1:
        return json.loads((runs[0] / "summary.json").read_text())
    from tts_bench.metrics import derive_summary
    from tts_bench.models import RequestRecord, RunSummary

    records, scheduled, dropped, peak = [], 0, 0, 0
    for run in runs:
        part = RunSummary.model_validate_json((run / "summary.json").read_text())
        scheduled, dropped, peak = scheduled + part.scheduled_requests, dropped + part.dropped_requests, \
            peak + part.peak_in_flight
        for line in (run / "requests.jsonl").read_text().splitlines():
            if line.strip():
                records.append(RequestRecord.model_validate_json(line))
    config = json.loads((runs[0] / "run.json").read_text())
    summary = derive_summary(
        run_id="+".join(json.loads((r / "run.json").read_text())["run_id"] for r in runs),
        target=part.target, transport=part.transport,
        requested_rps=sum(json.loads((r / "run.json").read_text())["requested_rps"] for r in runs),
        warmup_ns=round(config["warmup_s"] * 1e9), duration_ns=round(config["duration_s"] * 1e9),
        scheduled_requests=scheduled, dropped_requests=dropped, records=records,
        peak_in_flight=peak, setup=part.setup)
    return summary.model_dump(mode="json")


def row(meta: dict[str, Any], config: dict[str, Any], s: dict[str, Any], runs: list[Path], root: Path) -> dict:
    def dist(name: str, key: str) -> float | None:
        value = s[name].get(key)
        return None if value is None else round(value, 3)

    requests = s["started_requests"]
    return {
        "benchmark": "tts-bench", "engine": meta["engine"], "model": meta.get("model"),
        "transport": s["transport"], "target": s["target"], "rps": meta.get("rps", s["requested_rps"]),
        "seed": meta.get("seed", config["seed"]), "actual_rps": round(s["actual_rps"], 3),
        "ttfa_ms_p50": dist("first_playable_ms", "p50"), "ttfa_ms_p95": dist("first_playable_ms", "p95"),
        "ttfa_ms_p99": dist("first_playable_ms", "p99"),
        "audible_ttfa_ms_p50": dist("audible_ttfa_ms", "p50"), "audible_ttfa_ms_p95": dist("audible_ttfa_ms", "p95"),
        "e2e_ms_p50": dist("end_to_end_ms", "p50"), "e2e_ms_p95": dist("end_to_end_ms", "p95"),
        "underrun_requests": s["underrun_requests"], "requests": requests,
        "successful_requests": s["successful_requests"], "dropped_requests": s["dropped_requests"],
        "audible_requests": s["audible_requests"], "audio_s_per_s": round(s["received_audio_xrt"], 2),
        "behind_realtime_share": round(s["underrun_requests"] / requests, 4) if requests else None,
        "audio_s_mean": dist("audio_duration_s", "mean"), "prompt_words_mean": dist("prompt_word_count", "mean"),
        "scheduling_lag_ms_p95": dist("scheduling_lag_ms", "p95"), "peak_in_flight": s["peak_in_flight"],
        "largest_stall_ms": round(s["largest_stall_ms"], 3),
        "final_text_to_first_playable_ms_p95": (s.get("final_text_to_first_playable_ms") or {}).get("p95"),
        "max_new_tokens": meta.get("max_new_tokens"), "clients": len(runs),
        "warmup_s": config["warmup_s"], "duration_s": config["duration_s"],
        "runs": [str(r.relative_to(root)) for r in runs],
    }


def collect(root: Path, only: str | None = None) -> list[dict]:
    """Rows of every run under `root`, or only of the rate `only` (ENGINE/TRANSPORT/TARGET/RPS)."""
    groups: dict[str, list[Path]] = defaultdict(list)
    metas: dict[str, dict] = {}
    for meta_path in sorted(root.rglob("q3tts-run.json")):
        run = meta_path.parent
        if not (run / "summary.json").is_file():
            print(f"skipped (incomplete): {run}", file=sys.stderr)
            continue
        meta = json.loads(meta_path.read_text())
        if only and not _is_rate(meta, json.loads((run / "run.json").read_text()), only):
            continue
        group = meta.get("group", str(run))
        groups[group].append(run)
        metas[group] = meta
    rows = []
    for group, runs in groups.items():
        config = json.loads((runs[0] / "run.json").read_text())
        rows.append(row(metas[group], config, load_summary(runs), runs, root))
    rows.sort(key=lambda r: (r["engine"], r["transport"], r["target"], r["rps"], r["seed"]))
    return rows


def _is_rate(meta: dict, config: dict, key: str) -> bool:
    engine, transport, target, rps = key.split("/")
    return (meta["engine"], config["transport"], config["target"]) == (engine, transport, target) \
        and float(meta.get("rps", config["requested_rps"])) == float(rps)


def table(rows: list[dict]) -> str:
    """Medians over seeds per rate (tts-bench's reports' headline), one line each."""
    by_rate: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_rate[(r["engine"], r["transport"], r["target"], r["rps"])].append(r)
    lines = ["engine          transport target     rps  seeds actual  ttfa50  ttfa95 aud95   e2e95  underrun "
             "requests audio-s/s lag95"]
    for (engine, transport, target, rps), rs in by_rate.items():
        med = {k: statistics.median(x[k] for x in rs if x[k] is not None) if any(x[k] is not None for x in rs)
               else float("nan") for k in ("actual_rps", "ttfa_ms_p50", "ttfa_ms_p95", "audible_ttfa_ms_p95",
                                           "e2e_ms_p95", "audio_s_per_s", "scheduling_lag_ms_p95")}
        lines.append(f"{engine:15s} {transport:9s} {target:9s} {rps:5g} {len(rs):5d} {med['actual_rps']:7.1f} "
                     f"{med['ttfa_ms_p50']:7.1f} {med['ttfa_ms_p95']:7.1f} {med['audible_ttfa_ms_p95']:6.1f} "
                     f"{med['e2e_ms_p95']:7.0f} {sum(x['underrun_requests'] for x in rs):8d} "
                     f"{sum(x['requests'] for x in rs):8d} {med['audio_s_per_s']:9.1f} "
                     f"{med['scheduling_lag_ms_p95']:5.1f}")
    return "\n".join(lines)


def gate(rows: list[dict], key: str, limit_ms: float) -> int:
    """0 if the rate `key` (ENGINE/TRANSPORT/TARGET/RPS) kept p95 TTFA within `limit_ms` (median over seeds, the
    larger of first-playable and audible) with no underrun and no failed request; 1 if not; 2 if it has no rows."""
    engine, transport, target, rps = key.split("/")
    rs = [r for r in rows if (r["engine"], r["transport"], r["target"]) == (engine, transport, target)
          and float(r["rps"]) == float(rps)]
    if not rs:
        print(f"gate {key}: no completed runs")
        return 2
    p95 = statistics.median(max(r["ttfa_ms_p95"] or float("inf"), r["audible_ttfa_ms_p95"] or float("inf"))
                            for r in rs)
    underruns = sum(r["underrun_requests"] for r in rs)
    failed = sum(r["requests"] - r["successful_requests"] for r in rs)
    ok = p95 <= limit_ms and underruns == 0 and failed == 0
    print(f"gate {key}: p95 TTFA {p95:.1f} ms (limit {limit_ms:g}), {underruns} underrun and {failed} failed "
          f"requests over {len(rs)} seeds: {'go on' if ok else 'stop'}")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="folder holding the run folders (searched recursively)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--env", type=Path, help="env.json from the run script (card, commit, date)")
    parser.add_argument("--command", default="", help="the command that made the runs")
    parser.add_argument("--gate", metavar="ENGINE/TRANSPORT/TARGET/RPS",
                        help="only say whether this rate passed (exit 0), failed (1) or has no runs (2)")
    parser.add_argument("--gate-ms", type=float, default=50.0)
    args = parser.parse_args()
    rows = collect(args.root, only=args.gate)
    if args.gate:
        sys.exit(gate(rows, args.gate, args.gate_ms))
    env = json.loads(args.env.read_text()) if args.env and args.env.is_file() else {}
    doc = {"card": env.get("card"), "date": env.get("date"), "commit": env.get("commit"),
           "command": args.command or env.get("command", ""), "env": env, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(rows))
    print(f"{len(rows)} rows -> {args.out}")


if __name__ == "__main__":
    main()

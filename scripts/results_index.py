"""Writes bench/results/README.md, the index of the committed results: per file what it measured (its benchmark,
and the docs/perf-notes.md entry or docs page that reads it), the card, the commit measured and the date, from the
file's own fields (the few files without them: MISSING_FIELDS).

Why generated: 70-odd files, each with its card, commit and command inside; an index written by hand would drift
from them. `--check` (tests/benchmarks/test_results_index.py) fails when the committed index is not what this writes.

usage: python scripts/results_index.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "README.md"
READERS = [REPO / "docs" / "perf-notes.md", REPO / "docs" / "performance.md", REPO / "docs" / "faithfulness.md"]
KINDS = {  # the name's benchmark -> what it measures (bench/README.md has the commands)
    "codec": "bench/sweeps/codec_config_ab.py: the streaming codec's frame step with two sets of convolution tiles",
    "api": "`q3tts bench api`: the public API's time to first audio and throughput against the peers",
    "decode": "`q3tts bench decode`: ms per frame by batch size (with `--breakdown`: the frame's parts)",
    "faithfulness": "bench/faithfulness.py: the bf16 fast path's logits against the fp32 reference, by teacher "
                    "forcing",
    "prefill-stall": "bench/prefill_stall.py: how long admitting newcomers stalls the running streams",
    "scale-out": "bench/scale_out.py: capacity of one engine against two behind `q3tts serve --devices`",
    "serving": "bench/serve_load.py: Poisson load, time to first audio and audio-seconds per second (in-process, "
               "or `http` over `q3tts serve`)",
    "streaming": "`q3tts bench streaming`: time to first audio of bursts of streams",
    "audio-fidelity": "bench/audio_fidelity.py: the engine's float32 audio against the official decode",
    "loop": "bench/loop.py: the engine loop's host work per iteration, old tree against new",
    "tts-bench": "bench/tts_bench/: the third-party tts-bench ladder, q3tts against a peer server",
    "live-text": "bench/live_text.py: live text against sentence cuts, first audio after the first word and "
                 "final-text latency",
    "dialogue": "bench/dialogue.py: a dialogue's turns at once against one turn and against one by one (CPU)",
    "ws-relay": "bench/ws_relay_cpu.py: the CPU a live-text WebSocket session costs the front and its engine "
                "process, old tree against new",
}
MISSING_FIELDS = {  # written before the benchmark recorded its card and commit: from the commit that added the file
    "2026-12-02-audio-fidelity-cpu.json": {"card": "CPU (2 cores)", "commit": "146e9a2"},
}
_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-(.+)-([a-z0-9]+)\.json$")
_ENTRY = re.compile(r"^(\d+)\. \*\*(.+?)\*\*", re.S | re.M)


def kind_of(stem: str) -> str:
    """The benchmark a result's name starts with (the longest known kind)."""
    return max((k for k in KINDS if stem == k or stem.startswith(k + "-")), key=len, default="")


def perf_note_entries() -> list[tuple[str, str, str]]:
    """(entry number, title, text) of every numbered entry of docs/perf-notes.md."""
    text = READERS[0].read_text()
    starts = list(_ENTRY.finditer(text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return [(m.group(1), " ".join(m.group(2).split()), text[m.start():end]) for m, end in zip(starts, ends)]


def readers(name: str, entries: list[tuple[str, str, str]]) -> str:
    """Where the docs read the file: the perf-notes entries citing it, and the docs pages."""
    cited = [f"perf-notes {number}" for number, _, text in entries if name in text]
    pages = [f"docs/{page.name}" for page in READERS[1:] if name in page.read_text()]
    return ", ".join(cited + pages) or "not cited"


def row(path: Path, entries: list[tuple[str, str, str]]) -> str:
    doc = json.loads(path.read_text())
    date, stem, card_tag = _NAME.match(path.name).groups()
    fields = {**MISSING_FIELDS.get(path.name, {}), **(doc if isinstance(doc, dict) else {})}
    kind = kind_of(stem)
    variant = stem[len(kind):].strip("-")
    card, commit = fields.get("card", card_tag), fields.get("commit", "not recorded")
    return (f"| `{path.name}` | {kind or stem}{f' ({variant})' if variant else ''} | {card} | {commit} | "
            f"{fields.get('date', date)[:10]} | {readers(path.name, entries)} |")


def render() -> str:
    entries = perf_note_entries()
    files = sorted(RESULTS.glob("*.json"))
    unknown = [p.name for p in files if not _NAME.match(p.name) or not kind_of(_NAME.match(p.name).group(2))]
    if unknown:
        raise SystemExit(f"results named outside DATE-BENCHMARK[-VARIANT]-CARD.json with a known BENCHMARK: {unknown}")
    kinds = "\n".join(f"- **{kind}**: {text}" for kind, text in KINDS.items())
    rows = "\n".join(row(path, entries) for path in files)
    return (f"# Committed benchmark results\n\n"
            f"Written by `python scripts/results_index.py` from the files themselves (do not edit by hand). Each "
            f"file is named `DATE-BENCHMARK[-VARIANT]-CARD.json` and holds its card, date, commit and the command "
            f"that produced it; bench/README.md says how to run each benchmark, docs/perf-notes.md what each "
            f"result showed.\n\n{kinds}\n\n"
            f"| file | benchmark (variant) | card | commit | date | read in |\n|---|---|---|---|---|---|\n{rows}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed index is not up to date")
    args = parser.parse_args()
    text = render()
    if args.check:
        if INDEX.exists() and INDEX.read_text() == text:
            return 0
        print(f"{INDEX.relative_to(REPO)} is out of date: run python scripts/results_index.py", file=sys.stderr)
        return 1
    INDEX.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

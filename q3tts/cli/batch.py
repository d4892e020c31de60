"""`q3tts batch`: many requests from a JSON-lines file, rendered through the batched engine into a folder.

Each line is one object: `text` (required), and as the checkpoint needs `speaker`, `voice` (a voice file),
`instruct`; optionally `language`, `seed`, `id` (the output's name, else the line number), `non_streaming_mode`
and any sampling field (`temperature`, `max_new_tokens`, ...). Every line is checked first: a bad one is reported
with its number and skipped, the rest run (the command then exits with status 1). Items whose output exists
already are skipped (run it again to resume). `manifest.jsonl` in the folder lists every item: its line, id,
file, seconds of audio, or its error. A `voice` path is read relative to the current folder.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from ..api.pieces import join
from ..api.tts import TTS
from ..errors import did_you_mean, quote
from ..request.builder import SAMPLING_ARGS, Request

_ID = re.compile(r"[\w.\-]{1,100}")
FIELDS = {"text", "id", "speaker", "voice", "instruct", "language", "seed", "non_streaming_mode"}


@dataclass
class Item:
    line: int
    id: str
    requests: list[Request]

    def file(self, out_dir: Path) -> Path:
        return out_dir / f"{self.id}.wav"


def read_items(tts: TTS, path: Path) -> tuple[list[Item], list[dict]]:
    """(valid items, one record per bad line with its number and error)."""
    items, errors, ids = [], [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = _item(tts, number, line)
            earlier = ids.get(item.id.lower())  # (case apart: one file on a case-blind file system)
            if earlier is not None:
                default = item.id == f"{number:06d}"  # (a line without an id is named by its number)
                case = f" as {earlier!r} (one file on macOS and Windows)" if earlier != item.id else ""
                raise ValueError(f"id {item.id!r}{' (the default: the line number)' if default else ''} is used by an "
                                 f"earlier line{case}" + (": give this line an `id`" if default else ""))
            ids[item.id.lower()] = item.id
            items.append(item)
        except (ValueError, TypeError, OSError) as e:
            errors.append({"line": number, "error": str(e)})
    return items, errors


def _item(tts: TTS, number: int, line: str) -> Item:
    try:
        job = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(job, dict):
        raise ValueError("a line must be a JSON object")
    item_id = str(job.pop("id", f"{number:06d}"))
    if not _ID.fullmatch(item_id):
        raise ValueError("id: 1-100 letters, digits, '.', '_' or '-'")
    text = job.pop("text", None)
    if text is None:
        raise ValueError("missing `text`")
    unknown = sorted(set(job) - FIELDS - SAMPLING_ARGS)
    if unknown:
        raise ValueError(_unknown_field(unknown[0]))
    return Item(number, item_id, tts.pieces(text, **job))


def _unknown_field(name: str) -> str:
    """A line's field that is neither a batch field nor a sampling one, named with what a line takes."""
    if name in ("ref_audio", "ref_text", "x_vector_only", "x_vector_only_mode"):
        return (f"unknown field {name!r}: a line clones no recording; make a voice file with `q3tts voice create` "
                "and give its path as `voice`")
    sampling = ", ".join(sorted(SAMPLING_ARGS - FIELDS))
    return (f"unknown field {quote(name)}" + did_you_mean(name, [*FIELDS, *SAMPLING_ARGS])
            + f"; a line takes {', '.join(sorted(FIELDS))} and the sampling fields {sampling}")


def run(tts: TTS, jobs: Path, out_dir: Path, window: int = 128, log=print) -> dict:
    """Renders every valid, not yet rendered item of `jobs` into `out_dir`; returns the counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    items, errors = read_items(tts, jobs)
    for error in errors:
        log(f"line {error['line']}: {error['error']}")
    todo = [item for item in items if not item.file(out_dir).exists()]
    progress = _Progress(len(todo), log)
    manifest = [{"line": e["line"], "error": e["error"]} for e in errors]
    manifest += [_entry(item, out_dir, "skipped (already rendered)", _seconds(item.file(out_dir)))
                 for item in items if item not in todo]
    for item, wav in _render(tts, todo, window):
        partial = item.file(out_dir).with_suffix(".partial")  # renamed when whole: resume never sees half a file
        sf.write(partial, wav, tts.sample_rate, format="WAV")
        partial.replace(item.file(out_dir))
        manifest.append(_entry(item, out_dir, "rendered", len(wav) / tts.sample_rate))
        progress.done(len(wav) / tts.sample_rate)
    progress.close()
    manifest.sort(key=lambda entry: entry["line"])
    (out_dir / "manifest.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in manifest))
    return {"rendered": len(todo), "skipped": len(items) - len(todo), "bad_lines": len(errors)}


def _render(tts: TTS, items: list[Item], window: int) -> Iterator[tuple[Item, np.ndarray]]:
    """Each item's audio in order, with up to `window` items in the engine at once."""
    pending: deque = deque()
    queue = iter(items)
    while True:
        while len(pending) < window and (item := next(queue, None)) is not None:
            pending.append((item, [tts.submit(r, realtime=False) for r in item.requests]))
        if not pending:
            return
        item, streams = pending.popleft()
        yield item, join([s.read_all() for s in streams])


def _seconds(path: Path) -> float | None:
    """The length of an audio file rendered before (None if it cannot be read: a file of the same name made by
    something else)."""
    try:
        return sf.info(str(path)).duration
    except (sf.SoundFileError, OSError, RuntimeError):
        return None


def _entry(item: Item, out_dir: Path, status: str, seconds: float | None = None) -> dict:
    entry = {"line": item.line, "id": item.id, "file": item.file(out_dir).name, "status": status}
    if seconds is not None:
        entry["seconds"] = round(seconds, 3)
    return entry


class _Progress:
    """Items, audio seconds, speed and ETA on stderr: in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int, log):
        self.total, self.count, self.audio, self.log = total, 0, 0.0, log
        self.start, self.last = time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def done(self, seconds: float) -> None:
        self.count, self.audio = self.count + 1, self.audio + seconds
        now = time.perf_counter()
        if now - self.last >= (0.5 if self.tty else 10.0) or self.count == self.total:
            self.last = now
            self._show(now)

    def _show(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        eta = (self.total - self.count) * elapsed / max(self.count, 1)
        line = (f"{self.count}/{self.total} items, {self.audio:.1f} s of audio, {self.audio / elapsed:.1f}x real "
                f"time, ETA {eta:.0f} s")
        if self.tty:
            print(f"\r{line}   ", end="", file=sys.stderr, flush=True)
        else:
            self.log(line)

    def close(self) -> None:
        if self.tty and self.count:
            print(file=sys.stderr)


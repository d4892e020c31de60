"""A dialogue's script: turns, each a speaker (CustomVoice) or voice (Base) saying a text, with an optional
instruction, language and pause after it. Read from Python values, from JSON lines (`q3tts say --script`), or from
plain text with Kokoro's inline `[voice:name]` tags. Each bad turn is refused naming its index and field
(`turns[2].speaker`) before anything is generated; the requests themselves are checked by the request builder.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import RequestError, RequestTypeError, quote

MAX_PAUSE_S = 10.0
MAX_TURNS = 256
_TAG = re.compile(r"\[voice:\s*([^\]]*?)\s*\]")


@dataclass
class Turn:
    """One turn of a dialogue. `voice`: a Voice or voice file (Base); `speaker`: a preset speaker (CustomVoice);
    `pause`: seconds of silence after it."""

    text: str
    speaker: str | None = None
    voice: Any = None
    instruct: str | None = None
    language: str | None = None
    pause: float = 0.0


TURN_FIELDS = tuple(f.name for f in fields(Turn))


def check_turns(turns: Any) -> list[Turn]:
    """`turns` (Turns or dicts of Turn's fields) as Turns, their fields' types and pauses checked."""
    if isinstance(turns, (str, bytes)) or not hasattr(turns, "__iter__"):
        raise RequestTypeError(f"turns must be a list of turns (dicts or Turn), got {type(turns).__name__}", "turns")
    turns = list(turns)
    if not turns or len(turns) > MAX_TURNS:
        raise RequestError(f"a dialogue has 1 to {MAX_TURNS} turns, got {len(turns)}", "turns")
    return [_turn(i, t) for i, t in enumerate(turns)]


def turn_error(i: int, e: RequestError) -> RequestError:
    """A request's error as its turn's: "turn 2: ...", param turns[2].<field>."""
    return type(e)(f"turn {i}: {e.message}", f"turns[{i}].{e.param or 'text'}", e.code)


def _turn(i: int, value: Any) -> Turn:
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(TURN_FIELDS))
        if unknown:
            raise RequestTypeError(f"turn {i}: unknown field {quote(unknown[0])}; a turn takes "
                                   f"{', '.join(TURN_FIELDS)}", f"turns[{i}].{unknown[0]}")
        if "text" not in value:
            raise RequestError(f"turn {i}: `text` is missing", f"turns[{i}].text", "missing")
        value = Turn(**value)
    if not isinstance(value, Turn):
        raise RequestTypeError(f"turn {i}: expected a dict or Turn, got {type(value).__name__}", f"turns[{i}]")
    for name in ("text", "speaker", "instruct", "language"):
        given = getattr(value, name)
        if (given is not None or name == "text") and not isinstance(given, str):
            raise RequestTypeError(f"turn {i}: {name} must be a string, got {type(given).__name__}",
                                   f"turns[{i}].{name}")
    pause = value.pause
    if isinstance(pause, bool) or not isinstance(pause, (int, float)) or not math.isfinite(pause) or \
            not 0 <= pause <= MAX_PAUSE_S:
        raise RequestError(f"turn {i}: pause is seconds of silence after the turn, 0 to {MAX_PAUSE_S:g}, got "
                           f"{quote(pause)}", f"turns[{i}].pause")
    return value


def read_script(path: str | Path, kind: str) -> list[Turn]:
    """A script file: JSON lines of turns (`.jsonl`, or text whose first line is a JSON object), else plain text
    with Kokoro's `[voice:name]` tags (a name is a speaker on CustomVoice, a voice file on Base)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8-sig")  # (a BOM, as Notepad writes one, is not text)
    if path.suffix == ".jsonl" or text.lstrip().startswith("{"):
        return check_turns(_json_lines(path, text))
    return check_turns(tagged_turns(text, kind))


def tagged_turns(text: str, kind: str) -> list[dict]:
    """Plain text with Kokoro's `[voice:name]` tags: each tag starts a turn in that voice (text before the first
    tag is in no named voice: the default)."""
    if kind == "voice_design" and _TAG.search(text):
        raise RequestError("[voice:name] tags name voices; a VoiceDesign checkpoint has none (give JSON lines with "
                           "`instruct` per turn)", "turns")
    key = "speaker" if kind == "custom_voice" else "voice"
    parts = _TAG.split(text)
    turns = [{"text": parts[0].strip()}] if parts[0].strip() else []
    for name, said in zip(parts[1::2], parts[2::2]):
        if said.strip():
            turns.append({"text": said.strip(), key: name or None})
    return turns


def _json_lines(path: Path, text: str) -> list[dict]:
    turns = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            turns.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RequestError(f"{path}:{number}: not a JSON object ({e.msg})", "turns") from None
    return turns

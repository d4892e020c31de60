"""Cuts text into segments worth speaking on their own: text that arrives in pieces (an LLM's deltas, the
WebSocket) or a long text whole (`split_text`).

A segment ends at a sentence end (`.!?…` followed by whitespace, or CJK `。！？`), at a clause mark (`,;:—`,
CJK `，；：、`) once the segment is at least `clause_min_chars` long, or, failing both, at the last space
before `max_chars`. A period after a common abbreviation ("Mr.", "e.g.") or inside a number ("3.14") is no
end. Whitespace-led boundaries wait for the whitespace, so a sentence end is only cut once the next delta shows
that it really ended; `flush()` returns whatever remains. Pure: no I/O.
"""

from __future__ import annotations

import re

_SENTENCE = re.compile(r"[.!?…]+[\"'”’»)\]]*(?=\s)|[。！？]+[”’」』）)]*(?=[^”’」』）)])")
_CLAUSE = re.compile(r"[,;:—]+(?=\s)|[，；：、]+(?=.)", re.S)
_ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs", "etc", "e.g", "i.e", "no", "fig"}


class TextSegmenter:
    def __init__(self, clause_min_chars: int = 40, max_chars: int = 300):
        if not 0 < clause_min_chars <= max_chars:
            raise ValueError("0 < clause_min_chars <= max_chars is required")
        self.clause_min_chars, self.max_chars = clause_min_chars, max_chars
        self.buffer = ""

    def push(self, delta: str) -> list[str]:
        """Adds text; returns the segments it completed (maybe none)."""
        self.buffer += delta
        segments = []
        while (end := self._boundary()) is not None:
            segment, self.buffer = self.buffer[:end].strip(), self.buffer[end:]
            if segment:
                segments.append(segment)
        return segments

    def flush(self) -> list[str]:
        """Everything not yet returned, as segments (the text has ended, or the caller wants it spoken now)."""
        segments = self.push("")
        while self.buffer.strip():
            cut = self._length_cut() if len(self.buffer) > self.max_chars else len(self.buffer)
            segment, self.buffer = self.buffer[:cut].strip(), self.buffer[cut:]
            if segment:
                segments.append(segment)
        self.buffer = ""
        return segments

    def _boundary(self) -> int | None:
        sentence = next((m.end() for m in _SENTENCE.finditer(self.buffer) if not self._is_abbreviation(m.start())),
                        None)
        clause = next((m.end() for m in _CLAUSE.finditer(self.buffer)
                       if len(self.buffer[:m.end()].strip()) >= self.clause_min_chars), None)
        ends = [e for e in (sentence, clause) if e is not None and e <= self.max_chars]
        if ends:
            return min(ends)
        return self._length_cut() if len(self.buffer) > self.max_chars else None

    def _is_abbreviation(self, dot: int) -> bool:
        if self.buffer[dot] != ".":
            return False
        word = self.buffer[:dot].rsplit(None, 1)[-1].lower() if self.buffer[:dot].strip() else ""
        return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())

    def _length_cut(self) -> int:
        space = self.buffer.rfind(" ", 0, self.max_chars)
        return space if space > 0 else self.max_chars


def split_text(text: str, max_chars: int = 300) -> list[str]:
    """A whole text as pieces of at most `max_chars` characters: cut as the WebSocket cuts streamed text (at
    sentence ends, else clause marks, else spaces), then consecutive segments packed together up to `max_chars`
    (fewer, longer generations speak more naturally)."""
    segmenter = TextSegmenter(clause_min_chars=max_chars, max_chars=max_chars)
    pieces: list[str] = []
    for segment in segmenter.push(text) + segmenter.flush():
        if pieces and len(pieces[-1]) + 1 + len(segment) <= max_chars:
            pieces[-1] += " " + segment
        else:
            pieces.append(segment)
    return pieces

"""Live text: a request's text tokenized as it arrives, each token released once no later text can change it.

The whole-text prompt tokenizes "<|im_start|>assistant\\n{text}<|im_end|>..." in one call: NFC, then the added
tokens, then the pre-tokenizer's regex split, then BPE within each piece. BPE never crosses a piece, the regex has
no look-behind, and a piece that is not the last one of the text so far ends before the text does, so only the
last piece can still change (grow, or split) when text is appended: everything before the start of the last piece
tokenizes now exactly as it will in the whole text, and is released. At `end()` the rest is. The released ids
are thus `encode(assistant_text(whole))[3:-5]` whatever the chunking (tests/unit/test_live_text.py proves it on
random texts cut at random places, one character at a time included).

Three details keep the cut exact: text is kept NFC-normalized as it grows (NFC(NFC(a) + b) == NFC(a + b)), and a
cut is made only before a character that composes with nothing before it; a piece is an added token where the
text holds one (its content, e.g. "<|im_end|>"), and a tail that could still become one (say "<|im_") is held
back; the chat template's header ("<|im_start|>assistant\\n") is tokenized with the text, as in the whole prompt,
and its 3 tokens are not released.
"""

from __future__ import annotations

import re
import unicodedata
import weakref

from tokenizers import Regex, pre_tokenizers

from .text_tokenizer import PRETOKENIZE_REGEX, ROLE_PREFIX, TextTokenizer

HEADER_TOKENS = 3  # "<|im_start|>assistant\n" (TextTokenizer checks it)


class Pieces:
    """How a tokenizer cuts text into pieces before BPE: its added tokens, then the pre-tokenizer's regex. Built once
    per tokenizer (`pieces_of`) and shared by its live requests (a WebSocket server opens one per session)."""

    def __init__(self, added_contents: list[str]):
        self.split = pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated")
        added = sorted(added_contents, key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, added))) if added else None
        self.prefixes = frozenset(content[:i] for content in added for i in range(1, len(content)))
        self.longest_prefix = max(map(len, self.prefixes), default=0)

    def starts(self, text: str) -> list[int]:
        """The start of every pre-token piece of `text`: added tokens are pieces, the regex splits the rest."""
        starts, at = [], 0
        spans = [m.span() for m in self.added.finditer(text)] if self.added else []
        for start, end in [*spans, (len(text), len(text))]:
            if start > at:
                starts += [at + a for _, (a, _) in self.split.pre_tokenize_str(text[at:start])]
            if end > start:
                starts.append(start)
            at = end
        return starts

    def held_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that an added token starts with (it may still become one)."""
        return next((n for n in range(min(self.longest_prefix, len(text)), 0, -1) if text[-n:] in self.prefixes), 0)


_PIECES: weakref.WeakKeyDictionary[TextTokenizer, Pieces] = weakref.WeakKeyDictionary()


def pieces_of(tokenizer: TextTokenizer) -> Pieces:
    """The tokenizer's `Pieces`, built on first use."""
    if (pieces := _PIECES.get(tokenizer)) is None:
        pieces = _PIECES[tokenizer] = Pieces(tokenizer.added_contents())
    return pieces


class LiveText:
    """One request's text, appended in pieces of any size; `append` and `end` return the text token ids that
    became final (in order, all of them together the whole text's)."""

    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer
        self._pieces = pieces_of(tokenizer)
        self._pending = ROLE_PREFIX  # text not tokenized yet (NFC), from a piece's start
        self._header = HEADER_TOKENS  # header tokens still to drop from what is released
        self.num_tokens = 0  # text tokens released so far
        self.num_chars = 0  # characters appended so far
        self.ended = False

    def append(self, text: str) -> list[int]:
        """Adds `text`; returns the tokens it made final."""
        if self.ended:
            raise ValueError("text appended after the end")
        self.num_chars += len(text)
        self._pending = unicodedata.normalize("NFC", self._pending + text)
        cut = self._last_cut()
        return self._release(cut) if cut else []

    def end(self) -> list[int]:
        """No more text: returns the tokens still held."""
        self.ended = True
        return self._release(len(self._pending))

    def _release(self, cut: int) -> list[int]:
        ids = self._tokenizer.encode(self._pending[:cut])
        self._pending = self._pending[cut:]
        drop, self._header = min(self._header, len(ids)), self._header - min(self._header, len(ids))
        ids = ids[drop:]
        self.num_tokens += len(ids)
        return ids

    def _last_cut(self) -> int:
        """Where the last piece of the pending text starts (0: nowhere to cut yet), moved back to a place no later
        text can change: before any tail that could become an added token, at a character that composes with
        nothing before it."""
        text = self._pending
        limit = len(text) - self._pieces.held_tail(text)
        return next((start for start in reversed(self._pieces.starts(text))
                     if 0 < start <= limit and _stable_at(text, start)), 0)


def _stable_at(text: str, i: int) -> bool:
    """Whether NFC never joins text[:i] with what follows: text[i] is a starter that does not compose with text[i-1]
    (a combining mark appended later composes with text[i] at most)."""
    pair = text[i - 1:i + 1]
    return unicodedata.combining(text[i]) == 0 and unicodedata.normalize("NFC", pair) == pair

"""Live text: a request's text tokenized as it arrives, each token released once no later text can change it.

The whole-text prompt tokenizes "<|im_start|>assistant\\n{text}<|im_end|>..." in one call: NFC, then the added
tokens, then the pre-tokenizer's regex split, then BPE within each piece. BPE never crosses a piece, the regex has
no look-behind, and a piece that is not the last one of the text so far ends before the text does, so only the
last piece can still change (grow, or split) when text is appended: everything before the start of the last piece
tokenizes now exactly as it will in the whole text, and is released. One tokenizer pass an append gives both the
ids and the pieces they came from (`TextTokenizer.encode_pieces`: the encoding's words). At `end()` the rest is. The
released ids are thus `encode(assistant_text(whole))[3:-5]` whatever the chunking (tests/unit/test_live_text.py
proves it on random texts cut at random places, one character at a time included).

Three details keep the cut exact: text is kept NFC-normalized as it grows (NFC(NFC(a) + b) == NFC(a + b)), and a
cut is made only before a character that composes with nothing before it; a piece is an added token where the
text holds one (its content, e.g. "<|im_end|>"), and a tail that could still become one (say "<|im_") is held
back; the chat template's header ("<|im_start|>assistant\\n") is tokenized with the text, as in the whole prompt,
and its 3 tokens are not released.
"""

from __future__ import annotations

import bisect
import unicodedata
import weakref

from .text_tokenizer import ROLE_PREFIX, TextTokenizer

HEADER_TOKENS = 3  # "<|im_start|>assistant\n" (TextTokenizer checks it)


class AddedTokenStarts:
    """The beginnings of a tokenizer's added tokens, which a text's tail may still grow into. Built once per tokenizer
    (`added_starts_of`) and shared by its live requests (a WebSocket server opens one per session)."""

    def __init__(self, added_contents: list[str]):
        self.prefixes = frozenset(content[:i] for content in added_contents for i in range(1, len(content)))
        self.longest_prefix = max(map(len, self.prefixes), default=0)
        self.firsts = frozenset(prefix[0] for prefix in self.prefixes)

    def held_tail(self, text: str) -> int:
        """The length of the longest tail of `text` that an added token starts with (it may still become one)."""
        tail = text[-self.longest_prefix:] if self.longest_prefix else ""
        if not any(first in tail for first in self.firsts):  # (the usual case: no tail can start one)
            return 0
        return next((n for n in range(len(tail), 0, -1) if tail[-n:] in self.prefixes), 0)


_ADDED: weakref.WeakKeyDictionary[TextTokenizer, AddedTokenStarts] = weakref.WeakKeyDictionary()


def added_starts_of(tokenizer: TextTokenizer) -> AddedTokenStarts:
    """The tokenizer's `AddedTokenStarts`, built on first use."""
    if (starts := _ADDED.get(tokenizer)) is None:
        starts = _ADDED[tokenizer] = AddedTokenStarts(tokenizer.added_contents())
    return starts


class LiveText:
    """One request's text, appended in pieces of any size; `append` and `end` return the text token ids that
    became final (in order, all of them together the whole text's)."""

    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer
        self._added = added_starts_of(tokenizer)
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
        ids, starts = self._tokenizer.encode_pieces(self._pending)  # (one pass: its pieces cut it)
        cut = self._last_cut(starts)
        return self._release(ids[:bisect.bisect_left(starts, cut)], cut) if cut else []

    def end(self) -> list[int]:
        """No more text: returns the tokens still held."""
        self.ended = True
        return self._release(self._tokenizer.encode(self._pending), len(self._pending))

    def _release(self, ids: list[int], cut: int) -> list[int]:
        """The ids of the pending text up to `cut` are final: released, but for the header's."""
        self._pending = self._pending[cut:]
        drop, self._header = min(self._header, len(ids)), self._header - min(self._header, len(ids))
        ids = ids[drop:]
        self.num_tokens += len(ids)
        return ids

    def _last_cut(self, starts: list[int]) -> int:
        """Where the last piece of the pending text starts (0: nowhere to cut yet; `starts`: each token's piece's
        start), moved back to a place no later text can change: before any tail that could become an added token,
        at a character that composes with nothing before it. The ids of the pieces before it are the same as those
        of the text up to it (BPE never crosses a piece)."""
        text = self._pending
        limit = len(text) - self._added.held_tail(text)
        return next((start for start in reversed(dict.fromkeys(starts))
                     if 0 < start <= limit and _stable_at(text, start)), 0)


def _stable_at(text: str, i: int) -> bool:
    """Whether NFC never joins text[:i] with what follows: text[i] is a starter that does not compose with text[i-1]
    (a combining mark appended later composes with text[i] at most)."""
    pair = text[i - 1:i + 1]
    return unicodedata.combining(text[i]) == 0 and unicodedata.normalize("NFC", pair) == pair

"""Live text's tokens are the whole text's, however the text is cut into appends (request/live_text.py)."""

from __future__ import annotations

import random

import pytest

from q3tts.request.live_text import LiveText
from q3tts.request.text_tokenizer import TextTokenizer, assistant_text
from q3tts.tiny import tiny_checkpoint

ALPHABET = (list("abcdefghijklmnopqrstuvwxyz") + list("ABCXYZ") + list("0123456789") + list(" " * 8)
            + list(".,!?;:'\"-/()") + ["\n", "\r\n", "\t", "  "] + list("你好世界こんにちは")
            + ["é", "e\u0301", "\u0301", "\u0308", "ñ", "ß", "Ç", "😀", "👍🏽", "\u200d"]
            + ["<|im_end|>", "<|", "im_", "|>", "<tts_pad>"]
            + ["hello", " world", "The", " quick", "CamelCase", " it's", " don't", "3.14", " 2026"])


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.from_folder(tiny_checkpoint("tiny"))


def whole(tokenizer: TextTokenizer, text: str) -> list[int]:
    return tokenizer.encode(assistant_text(text))[3:-5]


def live(tokenizer: TextTokenizer, chunks: list[str]) -> list[int]:
    text, ids = LiveText(tokenizer), []
    for chunk in chunks:
        ids += text.append(chunk)
    return ids + text.end()


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60)))


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_random_texts_and_chunkings_give_the_whole_texts_tokens(tokenizer):
    rng = random.Random(0)
    for _ in range(400):
        text = random_text(rng)
        expected = whole(tokenizer, text)
        assert live(tokenizer, list(text)) == expected, repr(text)  # one character at a time
        for _ in range(3):
            chunks = random_chunks(rng, text)
            assert live(tokenizer, chunks) == expected, repr(chunks)


@pytest.mark.parametrize("text", ["Hello world. How are you?", "\nA leading newline", " leading space",
                                  "trailing spaces   ", "a<|im_end|>b", "ends with <|im_", "3.14159, 42!",
                                  "e\u0301e\u0301", "한국어 텍스트", "line\n\n\nbreaks\r\n"])
def test_known_hard_texts(tokenizer, text):
    assert live(tokenizer, list(text)) == whole(tokenizer, text)
    assert live(tokenizer, [text]) == whole(tokenizer, text)


def test_tokens_are_released_as_soon_as_a_later_piece_starts(tokenizer):
    text = LiveText(tokenizer)
    assert text.append("Hello") == []  # "Hello" may still grow
    first = text.append(" wor")
    assert first == tokenizer.encode("Hello")
    assert text.append("ld") == []
    assert first + text.end() == whole(tokenizer, "Hello world")
    assert text.num_tokens == len(whole(tokenizer, "Hello world"))
    with pytest.raises(ValueError):
        text.append("more")

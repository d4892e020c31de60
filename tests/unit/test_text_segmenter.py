"""How text is cut into pieces worth speaking on their own: streamed (the WebSocket) or whole (long texts)."""

from __future__ import annotations

from q3tts.request.text_segmenter import TextSegmenter, split_text


def _feed(segmenter: TextSegmenter, pieces: list[str]) -> list[str]:
    out = []
    for piece in pieces:
        out += segmenter.push(piece)
    return out + segmenter.flush()


def test_sentences_are_cut_once_the_next_delta_confirms_them():
    s = TextSegmenter()
    assert s.push("Hello there.") == []  # might be "there.5" or "there..." still
    assert s.push(" How") == ["Hello there."]
    assert s.push(" are you? I") == ["How are you?"]
    assert s.flush() == ["I"]


def test_abbreviations_numbers_and_initials_do_not_end_sentences():
    text = "Mr. Smith paid 3.14 dollars to J. Doe, e.g. for tea. Done."
    assert _feed(TextSegmenter(), list(text)) == ["Mr. Smith paid 3.14 dollars to J. Doe, e.g. for tea.", "Done."]


def test_clauses_cut_only_long_segments():
    s = TextSegmenter(clause_min_chars=20)
    assert s.push("Short, ") == []
    assert s.push("and now it is long enough, ") == ["Short, and now it is long enough,"]


def test_cjk_punctuation_needs_no_space():
    assert _feed(TextSegmenter(), ["你好。", "今天天气", "很好！谢谢"]) == ["你好。", "今天天气很好！", "谢谢"]


def test_text_without_punctuation_is_cut_at_a_space_before_max_chars():
    s = TextSegmenter(clause_min_chars=10, max_chars=30)
    segments = _feed(s, ["word " * 20])
    assert all(len(seg) <= 30 for seg in segments) and " ".join(segments) == ("word " * 20).strip()


def test_flush_speaks_whatever_is_buffered():
    s = TextSegmenter()
    s.push("an unfinished thought")
    assert s.flush() == ["an unfinished thought"] and s.flush() == []


def test_split_text_packs_sentences_into_pieces():
    sentences = [f"Sentence number {i} is here, with a clause." for i in range(20)]
    text = " ".join(sentences)
    pieces = split_text(text, max_chars=200)
    assert all(len(p) <= 200 for p in pieces) and " ".join(pieces) == text
    assert all(p.endswith(".") for p in pieces) and [len(p) for p in pieces] == [167, 167, 169, 171, 171]
    assert split_text("Short.") == ["Short."]
    long_word = "x" * 500  # no boundary at all: cut at the limit
    assert [len(p) for p in split_text(long_word, max_chars=200)] == [200, 200, 100]
    assert split_text("你好。今天天气很好！谢谢。" * 30, max_chars=50)[0].endswith("。")

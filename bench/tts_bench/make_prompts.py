"""English prompts with the length distribution of Seed-TTS-eval's English set, in tts-bench's dataset format.

tts-bench's canonical prompt pool is the 1,088 English Seed-TTS rows (Common Voice sentences), downloaded from
the Hugging Face hub by `bench dataset prepare`; the GPU machine has no network and the hub is not reachable here
either, so this writes a stand-in pool of the same size and length distribution instead. With random weights
only the lengths matter: the text's tokens set the prefill and how long text is fed beside the frames, its words
set the WebSocket's ingress (one word per append, 10 ms apart).

The length distribution is an estimate, not a measurement of the real file (which could not be read here):
  * Common Voice's sentence rules ask for sentences of at most 14 words, most of its English text is 5-14
    words, and a few older rows run longer;
  * the ten Seed-TTS English target texts published in wawa9149/tts-eval (examples/seedtts_en/meta.lst, taken
    from the real meta.lst) have 6, 6, 6, 8, 8, 10, 10, 11, 16 and 22 words: mean 10.3, median 9;
  * the Seed-TTS reference clips in zhaochenyang20/seed-tts-eval-50 last 3.2-7.7 s.
So the word counts are drawn from a log-normal with median 9.5 and sigma 0.38, rounded and clipped to [3, 28]
(mean ~10, p95 ~18 words), and each sentence is built to have exactly its drawn count as tts-bench counts
words (`tts_bench.dataset.count_words`).

    python bench/tts_bench/make_prompts.py --out bench/tts_bench/prompts-en.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
from pathlib import Path

ROWS = 1_088  # the size of Seed-TTS-eval's English pool, so tts-bench's epochs of the pool match
MEDIAN_WORDS, SIGMA, MIN_WORDS, MAX_WORDS = 9.5, 0.38, 3, 28
_WORD_RE = re.compile(r"[A-Za-z0-9]+(?:['\N{RIGHT SINGLE QUOTATION MARK}-][A-Za-z0-9]+)*")  # tts-bench's

def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


NOUNS = _words("river garden station window letter market village teacher doctor farmer painter sailor engine "
         "bridge kitchen library forest harbor island ticket blanket lantern basket wagon meadow castle "
         "tunnel factory museum valley office theater bakery bicycle camera candle cottage desert hammer "
         "jacket ladder mirror needle ocean pencil pillow pocket rabbit saddle shadow singer soldier storm "
         "tiger tower violin winter box road door car book bag dog cat boat hat key cup map bell")
ADJECTIVES = _words("quiet old small bright narrow heavy gentle empty busy distant broken wooden tired warm cold "
              "green dusty lonely strange simple hidden young red new long dark wet")
VERBS = _words("found painted carried opened watched crossed followed fixed visited closed cleaned noticed built "
         "borrowed sold moved lost left saw took")
SUBJECTS = ("She", "He", "They", "We", "I", "The children", "My brother", "Our neighbor", "The old man",
            "Her aunt", "The boy", "A stranger")
DETERMINERS = ("the", "the", "a", "his", "her", "their", "that")
PREPOSITIONS = ("in", "at", "on", "to", "near", "by", "under", "behind", "across", "into", "from")
# Phrases that extend a clause, by the number of words each adds ({n}: a noun, {a}: an adjective).
PHRASES = {
    1: ("again", "today", "early", "later", "too", "quickly", "twice", "yesterday"),
    2: ("last night", "this morning", "at once", "for hours", "by noon", "and smiled", "once more"),
    3: ("{p} the {n}", "{p} the {n}", "with a {n}", "for a while", "and then left", "after the storm"),
    4: ("{p} the {a} {n}", "before the {n} closed", "because it was late", "as the sun rose",
        "and walked back home"),
    5: ("when the {n} was ready", "and waited for the {n}", "so nobody would see it"),
}
SHORT = ("Close the door.", "Nobody answered.", "Wait for me.", "The rain stopped.", "Bring the map.",
         "Keep it simple.", "Stay right here.", "The bell rang.")


def draw_word_counts(rows: int, rng: random.Random) -> list[int]:
    counts = []
    for _ in range(rows):
        n = round(math.exp(rng.gauss(math.log(MEDIAN_WORDS), SIGMA)))
        counts.append(min(MAX_WORDS, max(MIN_WORDS, n)))
    return counts


def sentence(words: int, rng: random.Random) -> str:
    """One sentence of exactly `words` words: a subject-verb-object clause grown by phrases of 2-4 words."""
    if words <= 3:
        return rng.choice([s for s in SHORT if count_words(s) == words] or ["Close the door."])
    subject = rng.choice(SUBJECTS).split()
    core = [*subject, rng.choice(VERBS), rng.choice(DETERMINERS), rng.choice(NOUNS)]
    if words > len(core) and rng.random() < 0.4:
        core.insert(-1, rng.choice(ADJECTIVES))
    out = list(core)[:words]
    while len(out) < words:
        size = rng.choice([n for n in PHRASES if n <= words - len(out)])
        phrase = rng.choice(PHRASES[size]).format(p=rng.choice(PREPOSITIONS), n=rng.choice(NOUNS),
                                                  a=rng.choice(ADJECTIVES))
        if words - len(out) > size and rng.random() < 0.15:
            out[-1] += ","
        out += phrase.split()
    text = " ".join(out)
    return text[0].upper() + text[1:] + rng.choice("......?!")


def count_words(text: str) -> int:
    return len(_WORD_RE.findall(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("prompts-en.jsonl"))
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for i, words in enumerate(draw_word_counts(args.rows, rng)):
        text = sentence(words, rng)
        assert count_words(text) == words, (text, words)
        rows.append({"id": f"synthetic-en-{i:04d}", "text": text})
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    words = sorted(count_words(r["text"]) for r in rows)
    chars = sorted(len(r["text"]) for r in rows)
    q = lambda xs, p: xs[max(0, math.ceil(p * len(xs) / 100) - 1)]  # noqa: E731 (nearest rank, as tts-bench)
    print(f"{len(rows)} prompts -> {args.out}")
    for name, xs in (("words", words), ("chars", chars)):
        print(f"{name}: mean {statistics.mean(xs):.1f}, min {xs[0]}, p5 {q(xs, 5)}, p50 {q(xs, 50)}, "
              f"p95 {q(xs, 95)}, max {xs[-1]}")


if __name__ == "__main__":
    main()

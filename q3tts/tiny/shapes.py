"""Shapes of tiny checkpoints: the built-in one of each layout, or others drawn within the official families.

The built-in tiny checkpoints have one fixed shape per layout; equivalence tests against the official package
also need checkpoints whose widths, depths, head counts and upsampling differ, since code tested on one shape
can hide shape-dependent mistakes (a transposed weight that happens to be square, a window never reached) and
rounding that other shapes expose. `TinyShape` holds config overrides; `TinyShape.random` draws them within
what the official families allow: the "0b6" layout's code predictor as wide as the talker (its projection is the
identity), the "1b7" layout's narrower (a real projection); a talker and a codec transformer whose heads x head
width differ from their hidden size; 16 codebooks of 2048 codes; 1920 samples per frame from any factorisation
into upsampling ratios and vocoder rates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

CONDITIONS = ("blocks", "last")

# (upsampling_ratios, upsample_rates) whose product is 1920 samples per 12.5 Hz frame; the first is the official.
UPSAMPLINGS = (([2, 2], [8, 5, 4, 3]), ([2, 2], [6, 5, 4, 4]), ([4], [8, 5, 4, 3]), ([2], [8, 5, 4, 6]),
               ([2, 2, 2], [5, 4, 4, 3]), ([2, 2], [8, 10, 6]), ([3, 2], [10, 4, 4, 2]), ([2, 2], [4, 4, 5, 3, 2]))

TALKER_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "text_hidden_size"}
CODE_PREDICTOR_KEYS = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim"}
CODEC_KEYS = {"codebook_dim", "latent_dim", "decoder_dim", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window", "upsample_rates",
              "upsampling_ratios"}


@dataclass(frozen=True)
class TinyShape:
    """Overrides of a tiny checkpoint's sizes (absent keys keep the built-in shape's) and how its random vocoder
    is tamed. `condition`: "blocks" rescales each vocoder block to unit rms and then the last convolution so the
    waveform peaks at 0.5 (the built-in checkpoints: fp32 rounding reaches the audio at ~2e-6); "last" rescales
    only the last convolution, as the official-oracle recipe does, which leaves activations ~30x larger inside the
    vocoder, so that any two fp32 evaluations of it differ 5-50x more (an amplifier of rounding, as a trained
    decoder may be)."""

    talker: dict = field(default_factory=dict)  # talker_config keys
    code_predictor: dict = field(default_factory=dict)  # talker_config.code_predictor_config keys
    codec: dict = field(default_factory=dict)  # speech tokenizer decoder_config keys
    condition: str = "blocks"

    def __post_init__(self):
        for name, given, known in (("talker", self.talker, TALKER_KEYS),
                                   ("code_predictor", self.code_predictor, CODE_PREDICTOR_KEYS),
                                   ("codec", self.codec, CODEC_KEYS)):
            unknown = set(given) - known
            if unknown:
                raise ValueError(f"TinyShape.{name}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        if self.condition not in CONDITIONS:
            raise ValueError(f"TinyShape.condition must be one of {CONDITIONS}, got {self.condition!r}")

    @classmethod
    def random(cls, seed: int, size: str, condition: str = "last") -> TinyShape:
        """A shape drawn from `seed` within the official family of `size` ("0b6" or "1b7")."""
        if size not in ("0b6", "1b7"):
            raise ValueError(f"size must be '0b6' or '1b7', got {size!r}")
        rng = random.Random(seed)
        hidden = rng.choice([48, 64, 96, 128])
        talker = {**_attention(rng, hidden, (16, 32), (2, 4, 8)), "hidden_size": hidden,
                  "intermediate_size": rng.choice([2, 3]) * hidden, "num_hidden_layers": rng.randint(1, 4),
                  "text_hidden_size": rng.choice([w for w in (48, 64, 80, 112) if w != hidden])}
        cp_hidden = hidden if size == "0b6" else rng.choice([w for w in (32, 48, 64, 96) if w < hidden])
        code_predictor = {**_attention(rng, cp_hidden, (16, 32), (2, 4)), "hidden_size": cp_hidden,
                          "intermediate_size": 2 * cp_hidden, "num_hidden_layers": rng.randint(1, 3)}
        ratios, rates = rng.choice(UPSAMPLINGS)
        codec_hidden = rng.choice([16, 32, 48])
        codec = {**_attention(rng, codec_hidden, (8, 16), (2, 4)), "hidden_size": codec_hidden,
                 "intermediate_size": 2 * codec_hidden, "num_hidden_layers": rng.randint(1, 6),
                 "sliding_window": rng.choice([4, 8, 16, 24]), "codebook_dim": rng.choice([16, 32, 64]),
                 "latent_dim": rng.choice([32, 48, 64]), "upsampling_ratios": ratios, "upsample_rates": rates,
                 "decoder_dim": rng.choice([32, 64, 96]) * 2 ** max(0, len(rates) - 4)}
        return cls(talker, code_predictor, codec, condition)


def _attention(rng: random.Random, hidden: int, head_dims: tuple[int, ...], head_counts: tuple[int, ...]) -> dict:
    """Head count, KV head count (a divisor) and head width, with heads x head width != hidden (as officially)."""
    while True:
        heads, head_dim = rng.choice(head_counts), rng.choice(head_dims)
        if heads * head_dim != hidden:
            kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
            return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim}


def mrope_section(head_dim: int) -> list[int]:
    """Three M-RoPE sections covering head_dim / 2 in the official proportions (64 -> [24, 20, 20])."""
    half = head_dim // 2
    rest = half * 5 // 16
    return [half - 2 * rest, rest, rest]

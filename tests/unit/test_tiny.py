"""Tiny checkpoint shapes (q3tts/tiny/shapes.py): drawn shapes are valid checkpoints of their layout."""

from __future__ import annotations

import copy
import json
import math

import pytest

from q3tts.config import ModelConfig, SpeechTokenizerConfig
from q3tts.tiny import tiny_config
from q3tts.tiny.shapes import TinyShape
from q3tts.tiny.speech_tokenizer import TINY_SPEECH_TOKENIZER_CONFIG
from q3tts.tiny.text_tokenizer import write_tiny_text_tokenizer


@pytest.fixture(scope="module")
def text_ids(tmp_path_factory) -> dict[str, int]:
    return write_tiny_text_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("size", ["0b6", "1b7"])
def test_random_shapes_keep_their_layout(text_ids, size, tmp_path):
    """Over 40 seeds: configs q3tts parses, the layout's code predictor as wide as the talker (0b6) or narrower
    (1b7), heads x head width never the hidden size, 1920 samples per frame, and more than one shape drawn."""
    seen = set()
    for seed in range(40):
        shape = TinyShape.random(seed, size)
        assert TinyShape.random(seed, size) == shape  # (reproducible)
        path = tmp_path / "config.json"
        path.write_text(json.dumps(tiny_config("base", size, text_ids, shape)))
        talker = ModelConfig.from_file(path).talker_config
        cp = talker.code_predictor_config
        assert (cp.hidden_size == talker.hidden_size) == (size == "0b6")
        for c in (talker, cp):
            assert c.num_attention_heads * c.head_dim != c.hidden_size
        data = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG)
        data["decoder_config"].update(shape.codec)
        path.write_text(json.dumps(data))
        codec = SpeechTokenizerConfig.from_file(path).decoder_config
        assert math.prod(codec.upsampling_ratios + codec.upsample_rates) == 1920
        assert codec.decoder_dim % 2 ** len(codec.upsample_rates) == 0
        seen.add((talker.hidden_size, codec.decoder_dim, tuple(codec.upsample_rates)))
    assert len(seen) > 10


def test_shapes_are_checked(text_ids):
    with pytest.raises(ValueError, match="unknown keys"):
        TinyShape(codec={"decoder_width": 64})
    with pytest.raises(ValueError, match="condition"):
        TinyShape(condition="none")
    with pytest.raises(ValueError, match="narrower than"):
        tiny_config("base", "1b7", text_ids, TinyShape(talker={"hidden_size": 64}))  # the built-in predictor: 64

"""Voices users bring or build in Python: speaker embeddings (`Voice.from_embedding`) and blends (`Voice.blend`),
on the tiny Base checkpoints."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from q3tts import TTS, Voice
from q3tts.errors import RequestError
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

GREEDY = {"max_new_tokens": 5, "do_sample": False, "subtalker_dosample": False}


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("q3tts-cache")


@pytest.fixture(scope="module")
def base(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-base", tiny_root))


@pytest.fixture(scope="module")
def cloned(base) -> Voice:
    return base.create_voice((speech_like(1.0, 24000, 3), 24000), x_vector_only=True)


@pytest.mark.parametrize("value", ["no", None, 2])
def test_create_voice_takes_x_vector_only_as_a_bool(base, value):
    """(A string was read for its truth: x_vector_only="no" made an x-vector voice.)"""
    with pytest.raises(RequestError, match=f"x_vector_only must be True or False, got {re.escape(repr(value))}") as e:
        base.create_voice((speech_like(1.0, 24000, 3), 24000), "Hello.", x_vector_only=value)
    assert e.value.param == "x_vector_only"


def _audio(tts: TTS, voice, text: str = "Hello there.") -> np.ndarray:
    return tts.synthesize(text, voice=voice, seed=1, **GREEDY)


# ---- speaker embeddings --------------------------------------------------------------------------------------

def test_an_embedding_is_the_x_vector_voice_it_came_from(base, cloned):
    """From a tensor of any float dtype (a bf16 speaker.pt), a numpy array or a list: the same voice, the same
    audio as the x-vector clone the embedding came from (bf16 rounds it: its audio is compared to its own)."""
    embedding = cloned.ref_spk_embedding
    voice = Voice.from_embedding(embedding)
    assert voice.x_vector_only_mode and not voice.icl_mode and voice.ref_code is None
    assert voice.ref_spk_embedding.dtype == torch.float32 and voice.ref_spk_embedding.shape == (64,)
    expected = _audio(base, cloned)
    assert np.array_equal(_audio(base, voice), expected)
    assert np.array_equal(_audio(base, Voice.from_embedding(embedding.numpy())), expected)
    assert np.array_equal(_audio(base, Voice.from_embedding(embedding.reshape(1, -1).tolist())), expected)
    rounded = embedding.to(torch.bfloat16)
    assert torch.equal(Voice.from_embedding(rounded).ref_spk_embedding, rounded.float())


def test_embedding_files_torch_save_and_raw_float32(base, cloned, tmp_path):
    embedding = cloned.ref_spk_embedding
    torch.save(embedding.to(torch.bfloat16), tmp_path / "speaker.pt")
    raw = tmp_path / "speaker.f32"
    raw.write_bytes(embedding.numpy().astype("<f4").tobytes())
    assert torch.equal(Voice.from_embedding(tmp_path / "speaker.pt").ref_spk_embedding,
                       embedding.to(torch.bfloat16).float())
    assert torch.equal(Voice.from_embedding(str(raw)).ref_spk_embedding, embedding)
    assert np.array_equal(_audio(base, Voice.from_embedding(raw)), _audio(base, cloned))


@pytest.mark.parametrize("value, says", [
    (torch.full((64,), float("nan")), "NaN or infinite"),
    ([1.0] * 63 + [float("inf")], "NaN or infinite"),
    (torch.zeros(2, 64), "shape [2, 64]"),
    (torch.zeros(64, dtype=torch.int64), "float vector"),
    ([], "empty"),
    (["a"] * 64, "numbers"),
    ("speaker.pt", "not found"),
])
def test_bad_embeddings_are_refused_naming_the_argument(value, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RequestError, match=re.escape(says)) as e:
        Voice.from_embedding(value)
    assert e.value.param == "embedding"


def test_bad_embedding_files_are_refused_naming_the_file(tmp_path):
    (tmp_path / "odd.f32").write_bytes(b"\0" * 7)
    torch.save({"emb": torch.zeros(64)}, tmp_path / "dict.pt")
    torch.save(torch.full((64,), float("nan"), dtype=torch.bfloat16), tmp_path / "nan.pt")
    for name, says in (("odd.f32", "not a multiple of 4"), ("dict.pt", "holds a dict"), ("nan.pt", "NaN")):
        with pytest.raises(RequestError, match=says) as e:
            Voice.from_embedding(tmp_path / name)
        assert name in e.value.message and e.value.param == "embedding"


def test_an_embedding_of_another_size_or_checkpoint_kind_is_refused(base, tiny_root):
    says = "(embedding size 96); this checkpoint is 0.6B with embedding size 64"
    with pytest.raises(RequestError, match=re.escape(says)) as e:
        base.request("Hi.", voice=Voice.from_embedding(torch.zeros(96)))
    assert e.value.param == "voice"
    with pytest.raises(RequestError, match="was made for a 1.7B model"):
        base.request("Hi.", voice=Voice.from_embedding(torch.zeros(64), model_size="1b7"))
    with pytest.raises(RequestError, match="model_size must be one of") as e:
        Voice.from_embedding(torch.zeros(64), model_size="7b")
    assert e.value.param == "model_size"
    custom = TTS.from_pretrained(tiny_checkpoint("tiny", tiny_root))
    with pytest.raises(RequestError, match="cannot clone voices; use a Base checkpoint") as e:
        custom.request("Hi.", speaker="ryan", voice=Voice.from_embedding(torch.zeros(96)))
    assert e.value.param == "voice"


# ---- blends --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(base) -> tuple[Voice, Voice]:
    return tuple(base.create_voice((speech_like(1.0, 24000, seed), 24000), x_vector_only=True) for seed in (1, 2))


def test_a_blend_is_the_weighted_mean_of_the_embeddings(pair, tmp_path):
    """(2 a + 1 b) / 3 in float64, stored as float32; weights normalised ("a(2)+b(1)" is "a(4)+b(2)"); no other
    renormalisation; voice files count as voices."""
    a, b = pair
    mixed = Voice.blend({a: 2, b: 1})
    expected = ((2 * a.ref_spk_embedding.double() + b.ref_spk_embedding.double()) / 3).float()
    assert torch.equal(mixed.ref_spk_embedding, expected)
    assert mixed.x_vector_only_mode and not mixed.icl_mode and mixed.model_size == "0b6"
    assert torch.equal(Voice.blend([(a, 4.0), (b, 2.0)]).ref_spk_embedding, expected)
    a.save(tmp_path / "a.voice")
    assert torch.equal(Voice.blend({str(tmp_path / "a.voice"): 1, b: 0.5}).ref_spk_embedding, expected)
    assert torch.equal(Voice.blend({a: 3}).ref_spk_embedding, a.ref_spk_embedding)
    huge = Voice.blend({a: 1e308, b: 1e308}).ref_spk_embedding  # (finite weights whose sum is not: the same ratio)
    torch.testing.assert_close(huge, Voice.blend({a: 1, b: 1}).ref_spk_embedding, rtol=1e-6, atol=0)


def test_a_blend_speaks_and_keys_the_prefix_cache_on_the_mix(base, pair):
    from q3tts.engine.runner.prefix_cache import tensor_digest
    from q3tts.request.prompt import voice_digest

    a, b = pair
    def key(voice: Voice) -> bytes:
        spec = base.request("Hi.", voice=voice).spec
        return voice_digest(base.config, spec, tensor_digest(spec.speaker_embedding))

    assert key(Voice.blend({a: 2, b: 1})) == key(Voice.blend({a: 4, b: 2})) != key(Voice.blend({a: 1, b: 2}))
    assert key(Voice.blend({a: 1})) == key(a)
    mixed = _audio(base, Voice.blend({a: 1, b: 1}))
    assert len(mixed) == 4 * 1920 and not np.array_equal(mixed, _audio(base, a))


def test_blend_refusals_say_why(base, pair, tiny_root):
    a, b = pair
    in_context = base.create_voice((speech_like(1.0, 24000, 4), 24000), ref_text="Good morning.")
    large = TTS.from_pretrained(tiny_checkpoint("tiny-base-1.7b", tiny_root)).create_voice(
        (speech_like(1.0, 24000, 1), 24000), x_vector_only=True)
    for voices, says in (({a: 1, in_context: 1}, "voice 1 is an in-context voice: its reference recording's codes "
                                                 "and transcript cannot be mixed"),
                         ({a: 1, large: 1}, "different model sizes (embedding sizes [64, 96])"),
                         ({a: 0, b: 1}, "the weight of voice 0 must be a finite number > 0, got 0"),
                         ({a: float("nan")}, "finite number > 0"),
                         ({a: True}, "finite number > 0"),
                         ({}, "at least one voice"),
                         ({"missing.voice": 1}, "voice file not found")):
        with pytest.raises(RequestError, match=re.escape(says)) as e:
            Voice.blend(voices)
        assert e.value.param in ("voices", "voice")
    with pytest.raises(RequestError, match="neither|expected a Voice") as e:
        Voice.blend({5: 1})
    assert e.value.param == "voices"


@pytest.mark.parametrize("voices", ["a.voice", [("a.voice",)], 5])
def test_a_blend_of_something_other_than_voice_weight_pairs_is_named(voices):
    """(A path alone was "not enough values to unpack (expected 2, got 1)".)"""
    with pytest.raises(RequestError, match=r"voices: a blend takes \{voice: weight\} or \(voice, weight\) pairs") as e:
        Voice.blend(voices)
    assert e.value.param == "voices"

"""The voice prefix cache (engine/runner/prefix_cache.py): which prompt positions depend on the voice alone (checked on
the prompts themselves, mode by mode), cached and uncached requests give identical codes, the budget holds."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import soundfile as sf
import torch

from q3tts import TTS
from q3tts.engine import EngineConfig
from q3tts.engine.runner.prefix_cache import PrefixCache, tensor_digest
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

GREEDY = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def ref_wav(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(path, speech_like(1.5, 24000, 7), 24000)
    return path


def load(name: str, cache, prefix_cache_gb: float) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint(name, cache), device="cpu",
                               engine_config=EngineConfig(max_rows=4, prefix_cache_gb=prefix_cache_gb))


def modes(tts: TTS, name: str, ref_wav) -> dict[str, dict]:
    """Request arguments per mode of the checkpoint (all but the text)."""
    if name == "tiny":
        return {"preset": {"speaker": "ryan"}, "preset+instruct": {"speaker": "ryan", "instruct": "Slowly."},
                "preset, non-streaming": {"speaker": "ryan", "non_streaming_mode": True}}
    if name == "tiny-voice-design":
        return {"design": {"instruct": "A deep calm voice, speaking slowly and warmly."}}
    icl = tts.create_voice(str(ref_wav), "Good morning.")  # (a transcript shorter than the reference frames)
    xvec = tts.create_voice(str(ref_wav), x_vector_only=True)
    return {"x-vector": {"voice": xvec}, "in-context": {"voice": icl},
            "in-context, non-streaming": {"voice": icl, "non_streaming_mode": True}}


NAMES = ["tiny", "tiny-voice-design", "tiny-base"]
TEXTS = ["Hello there, how are you?", "A different sentence, rather longer than the first one was."]


@pytest.mark.parametrize("name", NAMES)
def test_the_prefix_depends_on_the_voice_alone(cache, ref_wav, name):
    """Two texts in one voice: the same prefix length and key, identical embeddings over it, and the text
    starts right after it (the next position differs); another voice has another key. A preset speaker's prefix
    is the same in streaming and non-streaming mode (so is its key); an in-context voice's is not."""
    tts = load(name, cache, 0)
    keys = {}
    for mode, kw in modes(tts, name, ref_wav).items():
        a, b = (tts.prepare(tts.request(text, language="english", **kw)) for text in TEXTS)
        assert a.prefix_len == b.prefix_len and 0 < a.prefix_len < a.num_positions, mode
        assert a.prefix_key == b.prefix_key, mode
        p = a.prefix_len
        torch.testing.assert_close(a.embeds[:p], b.embeds[:p], rtol=0, atol=0, msg=mode)
        assert not torch.equal(a.embeds[p], b.embeds[p]), f"{mode}: position {p} does not depend on the text"
        keys[mode] = a.prefix_key
    if name == "tiny":
        assert keys.pop("preset, non-streaming") == keys["preset"]
    assert len(set(keys.values())) == len(keys)


@pytest.mark.parametrize("name", NAMES)
def test_cached_and_uncached_requests_give_identical_codes(cache, ref_wav, name):
    with load(name, cache, 0.01) as cached, load(name, cache, 0) as uncached:
        for mode, kw in modes(cached, name, ref_wav).items():
            for text in TEXTS + TEXTS[:1]:
                got = cached.submit(cached.request(text, language="english", seed=1, **kw | GREEDY))
                want = uncached.submit(uncached.request(text, language="english", seed=1, **kw | GREEDY))
                a, b = got.read_all(), want.read_all()
                assert np.array_equal(np.stack(got.channel.codes), np.stack(want.channel.codes)), mode
                np.testing.assert_array_equal(a, b)
        prefixes = cached.engine.runner.prefix_cache
        assert prefixes.hits >= 2 * len(modes(cached, name, ref_wav)) and prefixes.bytes <= prefixes.max_bytes
        assert uncached.engine.runner.prefix_cache is None and uncached.engine.codec.references is None
        references = cached.engine.codec.references  # the codec's state after an in-context reference
        assert references.hits >= (5 if name == "tiny-base" else 0) and references.bytes <= references.max_bytes
        assert len(references.entries) == (1 if name == "tiny-base" else 0)


def test_a_burst_with_one_reference_decodes_it_once(cache, ref_wav):
    """Requests of one in-context voice: the reference is decoded once and copied into each row (within an
    admission, and from the cache across them), whose decoder state is then exactly that of decoding it there;
    the burst's codes equal the same requests' one by one with nothing kept (audio to rounding: a batch of rows
    is decoded together)."""
    texts = TEXTS + ["Third.", "And a fourth one."]
    with load("tiny-base", cache, 0.01) as together, load("tiny-base", cache, 0) as alone:
        voice = together.create_voice(str(ref_wav), "Good morning.")
        decoded = []
        codec = together.engine.codec
        decode_rows = codec.stream.decode_rows
        codec.stream.decode_rows = lambda *a, **k: decoded.append(1) or decode_rows(*a, **k)
        streams = [together.submit(together.request(t, language="english", voice=voice, seed=1, **GREEDY))
                   for t in texts]
        burst = [s.read_all() for s in streams]
        assert len(decoded) == 1  # (in one admission or several: then the second kept it)
        assert (codec.references_decoded, codec.references_reused) == (1, len(texts) - 1)
        for text, stream, audio in zip(texts, streams, burst):
            one = alone.submit(alone.request(text, language="english", voice=voice, seed=1, **GREEDY))
            one_audio = one.read_all()
            assert np.array_equal(np.stack(stream.channel.codes), np.stack(one.channel.codes))
            np.testing.assert_allclose(audio, one_audio, rtol=0, atol=1e-5)

        ref, codec.references = voice.ref_code, None  # nothing kept: the copy within one admission
        codec.start([0, 1, 2], [ref, None, ref])
        assert len(decoded) == 2
        copied = [t[[0, 2]].clone() for t in codec.stream.state.tensors()]
        codec.stream.reset([0, 1, 2])
        codec.stream.decode_rows([2], ref.T[None])
        for t, c in zip(codec.stream.state.tensors(), copied):
            assert torch.equal(t[2], c[0]) and torch.equal(t[2], c[1])


def test_the_budget_evicts_the_least_recently_used():
    kv = lambda: torch.zeros(2, 10, 2, 4)  # 640 bytes each of k and v
    prefixes = PrefixCache(max_bytes=3 * 2 * 640)
    for key in "abc":
        prefixes.put(key, kv(), kv())
    assert prefixes.get("a") is not None  # a is now the most recent
    prefixes.put("d", kv(), kv())
    assert list(prefixes.entries) == ["c", "a", "d"] and prefixes.bytes == 3 * 2 * 640
    assert prefixes.get("b") is None and (prefixes.hits, prefixes.misses) == (1, 1)
    prefixes.put("huge", torch.zeros(2, 100, 2, 4), torch.zeros(2, 100, 2, 4))  # larger than the budget: not kept
    assert "huge" not in prefixes.entries


def test_entries_made_together_count_their_storage_once():
    """Entries that are views of one tensor (a burst's prefixes gathered in one copy) count its bytes once, hold
    them while any of them is kept, and give them back with the last; the budget bounds the memory really held."""
    burst = torch.zeros(3, 2, 10)  # 240 bytes, three entries of 80
    prefixes = PrefixCache(max_bytes=400)
    for key, part in zip("abc", burst.split(1)):
        prefixes.put(key, part)
    assert prefixes.bytes == 240
    prefixes.put("d", torch.zeros(40))  # 160 bytes: fits beside the burst
    assert list(prefixes.entries) == ["a", "b", "c", "d"] and prefixes.bytes == 400
    prefixes.put("e", torch.zeros(10))  # 40 bytes: a and b leave, but the burst's storage is held by c
    assert list(prefixes.entries) == ["d", "e"] and prefixes.bytes == 200  # ... so c left too
    assert prefixes.get("a") is None
    prefixes.put("f", burst[0])  # a view of a storage no longer held: counted again, whole (d makes room)
    assert list(prefixes.entries) == ["e", "f"] and prefixes.bytes == 40 + 240


def test_voice_heads_are_built_once_and_never_stale(cache):
    """The positions before the text are kept per voice: a second prompt equals one built with nothing kept, and
    a change to the embeddings is seen at once."""
    from q3tts.request import prompt as prompt_module

    tts = load("tiny", cache, 0)
    request = tts.request("Hello there.", speaker="ryan", instruct="Slowly.", language="english")
    first = tts.prepare(request)
    again = tts.prepare(request)  # from the kept head
    prompt_module.forget_kept_heads()
    fresh = tts.prepare(request)
    assert torch.equal(again.embeds, fresh.embeds) and torch.equal(first.embeds, fresh.embeds)
    with torch.no_grad():
        tts.model.talker.model.codec_embedding.weight[tts.config.talker_config.spk_id["ryan"]] += 1.0
    changed = tts.prepare(request)
    prompt_module.forget_kept_heads()
    assert torch.equal(changed.embeds, tts.prepare(request).embeds)
    assert not torch.equal(changed.embeds, fresh.embeds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_built_together(cache, ref_wav, dtype):
    """A burst's prompts built in one call (build_prompts): in fp32 bit-identical to building each alone; in
    bf16 (the text of all of them projected together) the same layout, trailing ids and prefix, and embeddings
    equal to rounding."""
    from q3tts.request.prompt import build_prompt, build_prompts

    for name in NAMES:
        tts = TTS.from_pretrained(tiny_checkpoint(name, cache), device="cpu", dtype=dtype)
        specs = [tts.request(text, language="english", **kw).spec
                 for kw in modes(tts, name, ref_wav).values() for text in TEXTS]
        together = build_prompts(tts.model.talker, tts.config, specs)
        for spec, got in zip(specs, together):
            want = build_prompt(tts.model.talker, tts.config, spec)
            assert (got.trailing_ids, got.prefix_len, got.prefix_key) == (want.trailing_ids, want.prefix_len,
                                                                         want.prefix_key)
            for a, b in ((got.embeds, want.embeds), (got.trailing, want.trailing), (got.pad, want.pad)):
                if dtype == torch.float32:
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
            for start in (0, got.prefix_len, got.num_positions - 1):  # the pieces the engine joins for a prefill
                assert torch.equal(torch.cat(got.embeds_from(start)), got.embeds[start:])


def test_a_bursts_new_voices_are_computed_once_and_kept_together(cache, ref_wav):
    """A burst of new voices: each voice's parts (its head; an in-context voice's reference frames) are computed
    once for all its requests in the batch and kept per talker, where the next batch finds them; the prompts are
    those built one by one."""
    from q3tts.request import prompt as prompt_module
    from q3tts.request.prompt import build_prompt, build_prompts
    from q3tts.request.voice import Voice

    tts = TTS.from_pretrained(tiny_checkpoint("tiny-base", cache), device="cpu")
    hidden = tts.config.talker_config.hidden_size
    voices = [Voice(ref_code=None, ref_spk_embedding=torch.randn(hidden), x_vector_only_mode=True, icl_mode=False,
                    model_size=tts.config.tts_model_size) for _ in range(2)]
    voices.append(tts.create_voice(ref_wav, "A reference.", False))
    specs = [tts.request(text, voice=v, language="english").spec for v in voices for text in TEXTS]
    prompt_module.forget_kept_heads()
    together = build_prompts(tts.model.talker, tts.config, specs)
    heads = {id(p.parts[0]) for p in together}
    assert len(heads) == len(voices)  # one head per voice, shared by its requests
    kept = prompt_module.kept_heads(tts.model.talker)
    assert len(kept.entries) == len(voices) + 1  # the heads and the in-context voice's reference frames
    again = build_prompts(tts.model.talker, tts.config, specs)
    assert [id(p.parts[0]) for p in again] == [id(p.parts[0]) for p in together]  # found, not computed again
    for spec, got in zip(specs, together):
        assert torch.equal(got.embeds, build_prompt(tts.model.talker, tts.config, spec).embeds)


def spec_head(tts: TTS, spec) -> torch.Tensor:
    """A prompt's positions before the text, piece by piece as spec section 4.1 writes them (an instruction, the
    assistant header, then TTS_PAD ... TTS_BOS over the codec prefix without its codec_bos)."""
    from q3tts.request.prompt import language_id

    talker, c, tc = tts.model.talker, tts.config, tts.config.talker_config
    ids = lambda values: torch.tensor(values)
    lid = language_id(c, spec.language, spec.speaker)
    ctrl = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if lid is None
            else [tc.codec_think_id, tc.codec_think_bos_id, lid, tc.codec_think_eos_id])
    codec = [talker.embed_codec(ids(ctrl))]
    codec += [talker.embed_codec(ids([tc.spk_id[spec.speaker]]))] if spec.speaker else []
    codec += [spec.speaker_embedding.reshape(1, -1).to(talker.codec_head.weight.dtype)] \
        if spec.speaker_embedding is not None else []
    codec = torch.cat(codec + [talker.embed_codec(ids([tc.codec_pad_id]))])
    bos, _, pad = talker.embed_text(ids([c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id]))
    parts = [talker.embed_text(ids(spec.instruct_ids))] if spec.instruct_ids else []
    over = torch.cat([pad.expand(len(codec) - 1, -1), bos[None]])
    parts += [talker.embed_text(ids(spec.input_ids[:3])), over + codec]
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_voices_heads_computed_together(cache, ref_wav, dtype):
    """A burst of voices never seen before gets its heads computed together (`_voice_heads`: one lookup, one copy
    of the speaker embeddings, one synchronization): each bit for bit the spec's head for its request alone, in
    every mode (preset speakers with and without an instruction, designed voices, x-vectors, in-context voices,
    with and without a language tag), and one head per voice however many requests share it."""
    from q3tts.request import prompt as prompt_module
    from q3tts.request.prompt import build_prompts
    from q3tts.request.voice import Voice

    for name in NAMES:
        tts = TTS.from_pretrained(tiny_checkpoint(name, cache), device="cpu", dtype=dtype)
        kinds = list(modes(tts, name, ref_wav).values())
        if name == "tiny-base":  # a few x-vector voices besides the checkpoint's modes
            hidden = tts.config.talker_config.hidden_size
            kinds += [{"voice": Voice(ref_code=None, ref_spk_embedding=torch.randn(shape), x_vector_only_mode=True,
                                      icl_mode=False, model_size=tts.config.tts_model_size)}
                      for shape in (hidden, hidden, (1, hidden))]  # (a [1, H] embedding has the H values checked)
        elif name == "tiny-voice-design":
            kinds.append({"instruct": "A bright, fast voice."})
        specs = [tts.request(text, language=language, **kw).spec
                 for kw in kinds for language in ("english", "auto") for text in TEXTS]
        prompt_module.forget_kept_heads()
        together = build_prompts(tts.model.talker, tts.config, specs)
        voices = {prompt_module.voice_digest(tts.config, spec, None if spec.speaker_embedding is None
                                              else tensor_digest(spec.speaker_embedding))
                  for spec in specs}  # (modes may share a head)
        assert len({id(p.parts[0]) for p in together}) == len(voices)
        with torch.no_grad():
            for spec, got in zip(specs, together):
                assert torch.equal(got.parts[0], spec_head(tts, spec)), (name, spec.language, spec.speaker)


def test_a_full_cache_keeps_a_voice_the_second_time_it_is_seen():
    """While an entry fits, a missed key is wanted at once; once it would push entries out, a key is wanted only at
    its second miss, so one-off voices neither evict those in use nor cost the copy."""
    kv = lambda: torch.zeros(2, 10, 2, 4)  # 640 bytes each of k and v
    prefixes = PrefixCache(max_bytes=2 * 2 * 640)
    for key in "ab":
        assert prefixes.wants(key, 2 * 640)
        prefixes.put(key, kv(), kv())
    assert not prefixes.wants("c", 2 * 640) and not prefixes.wants("d", 2 * 640)  # full: seen once, declined
    assert list(prefixes.entries) == ["a", "b"] and prefixes.declined == 2
    assert prefixes.wants("c", 2 * 640)  # its second miss
    prefixes.put("c", kv(), kv())
    assert list(prefixes.entries) == ["b", "c"]
    assert not prefixes.wants("c", 2 * 640)  # (evicted later, it starts over as seen once)


def test_one_off_voices_do_not_evict_the_voice_in_use(cache, ref_wav):
    """An engine whose prefix cache holds one x-vector voice's prefix, not two: requests with new voices, each seen
    once, leave that voice's prefix cached (its next request a hit, with the same codes); a new voice's second
    request is kept in its place."""
    from q3tts.request.voice import Voice

    def codes(tts: TTS, voice: Voice) -> np.ndarray:
        stream = tts.submit(tts.request(TEXTS[0], voice=voice, language="english", seed=1, **GREEDY))
        stream.read_all()
        return np.stack(stream.channel.codes)

    with load("tiny-base", cache, 0.01) as probe:  # one x-vector prefix's bytes
        used = probe.create_voice(str(ref_wav), x_vector_only=True)
        codes(probe, used)
        entry = probe.engine.runner.prefix_cache.bytes
    with load("tiny-base", cache, 1.5 * entry / 2**30) as tts:
        prefixes, hidden = tts.engine.runner.prefix_cache, tts.config.talker_config.hidden_size
        codes = functools.partial(codes, tts)

        def new_voice() -> Voice:
            return Voice(ref_code=None, ref_spk_embedding=torch.randn(hidden), x_vector_only_mode=True,
                         icl_mode=False, model_size=tts.config.tts_model_size)

        first = codes(used)
        assert len(prefixes.entries) == 1 and (prefixes.hits, prefixes.misses) == (0, 1)
        for _ in range(3):
            codes(new_voice())
        assert prefixes.declined == 3 and (prefixes.hits, len(prefixes.entries)) == (0, 1)
        assert np.array_equal(codes(used), first) and prefixes.hits == 1
        twice = new_voice()
        codes(twice)
        codes(twice)  # its second miss: kept, the other pushed out
        assert prefixes.declined == 4 and len(prefixes.entries) == 1
        codes(twice)
        assert prefixes.hits == 2


def test_a_full_codec_cache_keeps_a_reference_the_second_time_it_is_seen(cache, ref_wav):
    """The codec's cache of decoder states after in-context references follows the same rule: with room for one
    state, a second reference seen once is decoded and not kept (the first stays), and kept when seen again."""
    with load("tiny-base", cache, 0) as tts:
        ref = tts.create_voice(str(ref_wav), "Good morning.").ref_code
        codec = tts.engine.codec
        codec.references = PrefixCache(int(1.5 * codec.state_bytes))
        other = torch.roll(ref, 1, 0)  # (another reference: its frames in another order)
        for refs, kept in (([ref], 1), ([other], 1), ([ref], 1), ([other, other], 1)):
            codec.start(list(range(len(refs))), refs)
            assert len(codec.references.entries) == kept
        assert codec.references.declined == 1 and codec.references_decoded == 3
        assert tensor_digest(other) in codec.references.entries  # its second time: kept, pushing the first out

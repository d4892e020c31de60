"""The fast decode path (ModelRunner), run eagerly on the CPU in fp32, against the reference decode loop."""

from __future__ import annotations

import pytest
import torch

from q3tts import TTS
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.engine.runner.readback import Readback
from q3tts.reference import generate_codes
from q3tts.request.prompt import build_prompt, prompt_length
from q3tts.sampling import SamplingParams
from q3tts.teacher_forcing import teacher_forced_logits
from q3tts.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path_factory.mktemp("cache")), device="cpu")


def _spec(tts: TTS, text: str, non_streaming: bool, speaker: str):
    return tts.request(text, speaker=speaker, language="english", non_streaming_mode=non_streaming).spec


def tiny_requests(tts: TTS):
    """Three prompts of different lengths, speakers and text modes, and their sampling (tests/kernels, tests/gpu)."""
    texts = ["Hello world, this is a test.", "Thank you.", "Good morning, seven bright stars shine above."]
    specs = [_spec(tts, t, ns, spk) for t, ns, spk in zip(texts, [False, True, False], ["ryan", "eric", "serena"])]
    prompts = [build_prompt(tts.model.talker, tts.config, s) for s in specs]
    params = [SamplingParams(do_sample=False, subtalker_dosample=False, max_new_tokens=14, seed=1),
              SamplingParams(max_new_tokens=9, seed=5),
              SamplingParams(temperature=1.2, top_k=20, top_p=0.9, subtalker_temperature=0.7, max_new_tokens=17,
                             seed=9)]
    return prompts, params


def run_engine(runner: ModelRunner, prompts, params) -> list[torch.Tensor]:
    """The engine's loop in its simplest form: every row grows its KV blocks before each frame."""
    rows = list(range(len(prompts)))
    runner.add_rows(rows, prompts, params)
    readback = Readback(runner)
    frames: list[list[torch.Tensor]] = [[] for _ in rows]
    done = torch.zeros(len(rows), dtype=torch.bool)
    step = 0
    while not done.all():
        for r, p in zip(rows, prompts):
            runner.grow(r, p.num_positions + step + 1)
        step += 1
        runner.step(len(rows))
        readback.push(len(rows))
        out = readback.pop()
        done = out.done
        for r in rows:
            if out.emitted[r]:
                frames[r].append(out.codes[r])
    runner.release_rows(rows)
    return [torch.stack(f) for f in frames]


@pytest.mark.parametrize("prefill_buckets", [(32, 64, 128, 256, 512), (8,)], ids=["padded", "beyond-buckets"])
def test_engine_matches_reference_loop(tts, prefill_buckets):
    """Prompts padded to a prefill bucket (padding into the scratch row) or, beyond the largest bucket, run
    unpadded: the codes are the reference loop's either way."""
    prompts, params = tiny_requests(tts)
    assert sum(p.embeds.shape[0] for p in prompts) > 8
    reference = generate_codes(tts.model.talker, prompts, params)
    runner = ModelRunner(tts.model, EngineConfig(max_rows=4, max_context=256, block_size=16, max_trailing=64,
                                                 prefill_buckets=prefill_buckets))
    ours = run_engine(runner, prompts, params)
    for r, (a, b) in enumerate(zip(ours, reference)):
        assert a.shape == b.shape and torch.equal(a, b), f"row {r}"
    # Rows are reusable: a second run on the same runner (blocks released and reserved again) agrees too.
    again = run_engine(runner, prompts[::-1], params[::-1])
    for a, b in zip(again, reference[::-1]):
        assert torch.equal(a, b)


def test_engine_hidden_states_match_teacher_forcing(tts):
    """The engine's talker hidden state after each frame gives the same logits as the reference model."""
    prompts, params = tiny_requests(tts)
    greedy = [SamplingParams(do_sample=False, subtalker_dosample=False, max_new_tokens=6, seed=0)]
    runner = ModelRunner(tts.model, EngineConfig(max_rows=2, max_context=128, block_size=16, max_trailing=64))
    runner.add_rows([0], prompts[:1], greedy)
    runner.grow(0, prompts[0].num_positions + 6)
    logits, frames = [], []
    for _ in range(5):
        logits.append(runner.head_logits(runner.state.hidden[:1], tts.model.talker.codec_head.weight)[0])
        runner.step(1)
        frames.append(runner.state.codes[0].clone())
    ref_logits, _ = teacher_forced_logits(tts.model.talker, prompts[0], torch.stack(frames))
    err = (torch.stack(logits) - ref_logits[:5]).abs().max() / ref_logits.abs().max()
    assert err < 1e-5


def test_engine_teacher_forcing_matches_reference(tts):
    prompts, params = tiny_requests(tts)
    codes = generate_codes(tts.model.talker, prompts[:1], params[:1])[0]
    runner = ModelRunner(tts.model, EngineConfig(max_rows=4, max_context=128, block_size=16, max_trailing=64))
    talker, cp = runner.teacher_forced_logits(prompts[0], codes)
    ref_talker, ref_cp = teacher_forced_logits(tts.model.talker, prompts[0], codes)
    assert talker.shape == ref_talker.shape and cp.shape == ref_cp.shape
    assert (talker - ref_talker).abs().max() / ref_talker.abs().max() < 1e-5
    assert (cp - ref_cp).abs().max() / ref_cp.abs().max() < 1e-5


def test_engine_config_prefill_buckets():
    assert EngineConfig(prefill_buckets=(128, 32)).prefill_buckets == (32, 128)
    assert EngineConfig(max_rows=8).prefill_buckets == (32, 64, 96, 128, 192, 256, 384, 512)
    assert EngineConfig(max_rows=64).prefill_buckets[-4:] == (768, 1024, 1536, 2048)
    with pytest.raises(ValueError, match="prefill_buckets"):
        EngineConfig(prefill_buckets=(0, 64))


def test_prompt_reuses_fixed_projections_until_the_weights_change(tts):
    """The special tokens' and the assistant header's text projections are computed once per set of weights:
    a second prompt is identical, and one built after the projection changes in place uses the new weights."""
    talker, spec = tts.model.talker, _spec(tts, "Hello there.", False, "ryan")
    first, again = build_prompt(talker, tts.config, spec), build_prompt(talker, tts.config, spec)
    assert torch.equal(first.embeds, again.embeds) and torch.equal(first.pad, again.pad)
    bias = talker.text_projection.linear_fc2.bias
    saved = bias.detach().clone()
    try:
        with torch.no_grad():
            bias += 1.0
        changed = build_prompt(talker, tts.config, spec)
        c = tts.config
        with torch.no_grad():  # the projection of the three special tokens together, as the prompt builds it
            assert torch.equal(changed.pad, talker.embed_text(torch.tensor(
                [c.tts_bos_token_id, c.tts_eos_token_id, c.tts_pad_token_id]))[2])
        assert not torch.equal(changed.pad, first.pad)
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    assert torch.equal(build_prompt(talker, tts.config, spec).embeds, first.embeds)


@pytest.mark.parametrize("name", ["tiny", "tiny-base", "tiny-voice-design"])
def test_prompt_length_is_known_before_building(name, tmp_path_factory):
    """The request builder checks the length budget from `prompt_length`, before any prompt is built: it must
    be the built prompt's length in every mode."""
    from tests.equivalence.test_equivalence import speech_like

    tts = TTS.from_pretrained(tiny_checkpoint(name, tmp_path_factory.mktemp("cache")), device="cpu")
    kinds = {"tiny": [{"speaker": "ryan"}, {"speaker": "eric", "instruct": "Slowly."},
                      {"speaker": "dylan", "language": "chinese"}, {"speaker": "ryan", "language": "auto"}],
             "tiny-voice-design": [{"instruct": "A calm voice."}, {"instruct": "Warm.", "language": "english"}]}
    if name == "tiny-base":
        audio = (speech_like(1.0, 24000, 3), 24000)
        kinds[name] = [{"voice": tts.create_voice(audio, "Good morning.")},
                       {"voice": tts.create_voice(audio, "A much longer transcript than the reference frames, one "
                                                         "that keeps going for a while.")},
                       {"voice": tts.create_voice(audio, x_vector_only=True)}]
    for kwargs in kinds[name]:
        for non_streaming in (False, True):
            spec = tts.request("Hello world, how are you?", non_streaming_mode=non_streaming, **kwargs).spec
            built = build_prompt(tts.model.talker, tts.config, spec)
            assert prompt_length(tts.config, spec) == built.embeds.shape[0], (kwargs, non_streaming)


def test_a_top_k_beyond_any_integer_type_keeps_every_token(tts):
    """A top-k of any size is valid (larger than the vocabulary: no cut, as in the official sampler); one beyond
    64 bits once failed the whole engine's batch (`torch.tensor` overflow) and with it every running stream."""
    prompts, params = tiny_requests(tts)
    unbounded = [SamplingParams(**{**vars(p), "top_k": 10**20, "subtalker_top_k": 10**30}) for p in params]
    disabled = [SamplingParams(**{**vars(p), "top_k": 0, "subtalker_top_k": 0}) for p in params]
    assert unbounded[2].top_k == 10**20  # kept as given
    runner = ModelRunner(tts.model, EngineConfig(max_rows=4, max_context=256, block_size=16, max_trailing=64))
    ours = run_engine(runner, prompts, unbounded)
    for a, b in zip(ours, generate_codes(tts.model.talker, prompts, disabled)):
        assert torch.equal(a, b)

"""The Python API on tiny random checkpoints: loading checks, input validation, seeds, voices."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

import q3tts
import q3tts.api.engine_host
import q3tts.api.loading
import q3tts.api.render
import q3tts.api.tts
from q3tts import TTS, Qwen3TTSModel, Voice, VoiceClonePromptItem
from q3tts.checkpoint import CheckpointError
from q3tts.config import ConfigError
from q3tts.errors import RequestError, RequestTypeError
from q3tts.request.audio import AudioError
from q3tts.sampling import SamplingParams
from q3tts.tiny import tiny_checkpoint
from tests.equivalence.test_equivalence import speech_like

FAST = {"max_new_tokens": 6}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("q3tts-cache")


@pytest.fixture(scope="session")
def custom(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny", tiny_root))


@pytest.fixture(scope="session")
def custom_small(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-custom-voice-0.6b", tiny_root))


@pytest.fixture(scope="session")
def base(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-base", tiny_root))


@pytest.fixture(scope="session")
def base_large(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-base-1.7b", tiny_root))


@pytest.fixture(scope="session")
def design(tiny_root) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint("tiny-voice-design", tiny_root))


@pytest.fixture(scope="session")
def ref_wav(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "ref.wav"
    sf.write(path, speech_like(1.0, 24000, 5), 24000)
    return path


@pytest.fixture
def no_compute(monkeypatch):
    """Fails the test if generation starts: bad input must be refused before any compute."""
    def refuse(*args, **kwargs):
        raise AssertionError("generation started for an invalid request")

    monkeypatch.setattr(q3tts.api.tts.TTS, "submit", refuse)
    monkeypatch.setattr(q3tts.api.render, "generate_codes", refuse)


# ---- loading ------------------------------------------------------------------------------------------------

def test_every_checkpoint_tensor_is_loaded(tiny_root, base):
    folder = tiny_checkpoint("tiny-base", tiny_root)
    stored = load_file(folder / "model.safetensors")
    state = base.model.state_dict()
    assert set(stored) == set(state)
    for name, value in stored.items():
        assert torch.equal(state[name], value), name


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(tiny_root, tmp_path):
    folder = _copy_checkpoint(tiny_checkpoint("tiny", tiny_root), tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["talker.codec_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*talker\.codec_head\.weight \[3072, 96\]"):
        TTS.from_pretrained(folder)


def test_misshapen_and_unexpected_tensors_are_named(tiny_root, tmp_path):
    folder = _copy_checkpoint(tiny_checkpoint("tiny", tiny_root), tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    tensors["talker.model.norm.weight"] = torch.ones(7)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"talker\.model\.norm\.weight has shape \[7\], expected \[96\]"):
        TTS.from_pretrained(folder)
    tensors["talker.model.norm.weight"] = torch.ones(96)
    tensors["talker.extra.weight"] = torch.ones(3)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*talker\.extra\.weight"):
        TTS.from_pretrained(folder)


def test_truncated_file_is_named(tiny_root, tmp_path):
    folder = _copy_checkpoint(tiny_checkpoint("tiny", tiny_root), tmp_path / "ckpt")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        TTS.from_pretrained(folder)


def test_bad_config_is_named(tiny_root, tmp_path):
    folder = _copy_checkpoint(tiny_checkpoint("tiny", tiny_root), tmp_path / "ckpt")
    (folder / "config.json").write_text('{"tts_model_type": "custom_voice"}')
    with pytest.raises(ConfigError, match=r"config\.json: required key 'tts_model_size' is missing"):
        TTS.from_pretrained(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json: file not found"):
        TTS.from_pretrained(folder)


def test_bad_generation_defaults_are_the_checkpoints_error(tiny_root, tmp_path):
    """(They once loaded, and every later request failed as if the user had passed them.)"""
    folder = _copy_checkpoint(tiny_checkpoint("tiny", tiny_root), tmp_path / "ckpt")
    (folder / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ConfigError, match=r"generation_config\.json: temperature must be a finite number > 0, "
                                          r"got 'hot'"):
        TTS.from_pretrained(folder)


def test_unreachable_hub_id_suggests_local_and_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"local folder.*tiny"):
        TTS.from_pretrained("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", cache_dir=tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        TTS.from_pretrained(tmp_path / "nothing-here")


def test_official_keywords_are_accepted(tiny_root):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tiny_root), device_map="cpu", dtype=torch.float32,
                              attn_implementation="sdpa")
    assert tts.device.type == "cpu"
    assert Qwen3TTSModel is TTS and VoiceClonePromptItem is Voice



def test_from_pretrained_takes_the_official_signature(tiny_root, tmp_path, monkeypatch):
    """The official `from_pretrained(pretrained_model_name_or_path, **kwargs)`: its keyword name and the common
    Hugging Face keywords; those about fetching reach the hub, those about transformers' model building are
    ignored, and unknown ones are refused."""
    folder = tiny_checkpoint("tiny", tiny_root)
    tts = TTS.from_pretrained(pretrained_model_name_or_path=folder, device_map="cpu", local_files_only=True,
                              token="hf_unused", revision="main", trust_remote_code=True, low_cpu_mem_usage=True,
                              attn_implementation="flash_attention_2")
    assert tts.config.tts_model_type == "custom_voice"
    with pytest.raises(TypeError, match="quantization_config"):
        TTS.from_pretrained(folder, quantization_config={"load_in_8bit": True})
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append({"repo_id": repo_id, **kwargs})
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(CheckpointError, match="Qwen/X: not in the local hub cache with local_files_only=True"):
        TTS.from_pretrained("Qwen/X", local_files_only=True, token="hf_abc", revision="r1", cache_dir=tmp_path)
    assert asked == [{"repo_id": "Qwen/X", "revision": "r1", "cache_dir": tmp_path, "local_files_only": True,
                      "token": "hf_abc"}]


def test_from_pretrained_names_a_model_or_engine_config_of_the_wrong_type(tiny_root):
    """(They failed inside: pathlib's "expected str, bytes or os.PathLike object", dataclasses' "replace() should be
    called on dataclass instances".)"""
    with pytest.raises(TypeError, match="pretrained_model_name_or_path must be a checkpoint folder.* got int"):
        TTS.from_pretrained(5)
    with pytest.raises(TypeError, match="engine_config must be a q3tts.EngineConfig .* got dict"):
        TTS.from_pretrained(tiny_checkpoint("tiny", tiny_root), engine_config={"max_rows": 2})


@pytest.mark.parametrize("device", ["mps", "meta", "xpu:0"])
def test_devices_other_than_cpu_and_cuda_are_refused(device):
    """(mps and meta were accepted, then failed with a traceback while loading.)"""
    with pytest.raises(ValueError, match=f"device '{device}' is not supported: use cpu, cuda or cuda:N"):
        q3tts.api.loading.resolve_device(device)

# ---- every mode, basic shape of the output ---------------------------------------------------------------

def test_modes_produce_audio(custom, design, base, ref_wav):
    wavs, sr = custom.generate_custom_voice("Hello world.", "ryan", **FAST)
    assert sr == 24000 and wavs[0].dtype == np.float32 and wavs[0].shape == (5 * 1920,)
    wavs, _ = design.generate_voice_design(["Hello.", "Thank you."], "A calm voice.", **FAST)
    assert len(wavs) == 2
    wavs, _ = base.generate_voice_clone("Hello.", ref_audio=str(ref_wav), ref_text="Good morning.", **FAST)
    assert wavs[0].shape == (5 * 1920,)  # the reference's share is cut off
    assert custom.get_supported_speakers()[0] == "aiden" and "auto" in custom.get_supported_languages()


def test_bytes_and_base64_reference_audio(base, ref_wav):
    import base64

    data = ref_wav.read_bytes()
    from_bytes = base.create_voice(data, "Good morning.")
    from_b64 = base.create_voice("data:audio/wav;base64," + base64.b64encode(data).decode(), "Good morning.")
    from_path = base.create_voice(str(ref_wav), "Good morning.")
    assert torch.equal(from_bytes.ref_code, from_path.ref_code)
    assert torch.equal(from_b64.ref_spk_embedding, from_path.ref_spk_embedding)


# ---- bad input is refused before any compute ---------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"speaker": "nobody"}, ValueError, "unknown speaker 'nobody'; supported: .*ryan"),
    ({"language": "klingon"}, ValueError, "unsupported language 'klingon'"),
    ({"speaker": 3}, TypeError, r"speaker must be a string, one of \[.*ryan.*\]; got int"),
    ({"language": {"en": 1}}, TypeError, r"language must be a string, one of \[.*english.*\]; got dict"),
    ({"text": ""}, ValueError, "text is empty"),
    ({"text": " \n\t "}, ValueError, "text is empty"),
    ({"text": "\u200b \u200f\ufeff\x00"}, ValueError, r"text has nothing to speak: only spaces and invisible "
                                                       r"characters \(U\+0000, U\+200B, U\+200F, U\+FEFF\)"),
    ({"text": "word " * 5000}, ValueError, "the limit is 4096"),
    ({"text": "Hi \ud800."}, ValueError, "text is not valid Unicode: surrogates not allowed at character 3"),
    ({"instruct": "calm\udfff"}, ValueError, "instruct is not valid Unicode"),
    ({"text": ["a", "b"], "speaker": ["ryan", "eric", "dylan"]}, ValueError, "batch size mismatch"),
    ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
    ({"top_p": 1.5}, ValueError, "top_p must be in"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive integer"),
    ({"max_new_tokens": 40000}, ValueError, "does not fit: .* of the model's 32768 positions"),
    ({"do_sample": "yes"}, ValueError, "do_sample must be True or False"),
    ({"top_k": 2.5}, ValueError, "top_k must be an integer"),
    ({"seed": -1}, ValueError, "seed must be a non-negative integer"),
    ({"seed": 2**63}, ValueError, r"seed must be a non-negative integer below 2\*\*63, got 9223372036854775808"),
    ({"temprature": 0.5}, TypeError, "unexpected generation arguments \\['temprature'\\] \\(did you mean "
                                     "`temperature`\\?\\)"),
    ({"speakr": "ryan"}, TypeError, "unexpected generation arguments \\['speakr'\\] \\(did you mean `speaker`"),
    ({"subtalker_temperature": 0}, ValueError, "use subtalker_dosample=False for greedy decoding"),
])
def test_custom_voice_input_errors(custom, no_compute, kwargs, error, match):
    args = {"text": "Hello.", "speaker": "ryan", **kwargs}
    with pytest.raises(error, match=match):
        custom.generate_custom_voice(**args)


def test_numpy_numbers_are_taken_as_python_ones():
    """(do_sample=np.bool_(False) was refused: "must be True or False, got np.False_".)"""
    params = SamplingParams(do_sample=np.bool_(False), subtalker_dosample=np.True_, top_k=np.int64(5),
                            temperature=np.float32(0.7))
    assert not params.do_sample and params.subtalker_dosample and params.top_k == 5


def test_a_runaway_guard_or_on_frame_of_the_wrong_type_is_refused_before_any_compute(custom, no_compute):
    """(runaway_guard=5 failed in the engine's submit with an AttributeError, on_frame=5 at the first frame.)"""
    with pytest.raises(TypeError, match="runaway_guard must be a RunawayGuard .* got 5") as e:
        custom.synthesize("Hello.", speaker="ryan", runaway_guard=5)
    assert e.value.param == "runaway_guard"
    with pytest.raises(TypeError, match="on_frame must be a function .* got int") as e:
        custom.synthesize("Hello.", speaker="ryan", on_frame=5)
    assert e.value.param == "on_frame"


def test_mode_not_supported_by_checkpoint(custom, design, base, no_compute):
    with pytest.raises(ValueError, match=r"generate_voice_design needs a VoiceDesign checkpoint \(e.g. Qwen/Qwen3-"
                                         r"TTS-12Hz-1.7B-VoiceDesign\); this one is 1.7B-CustomVoice: use "
                                         r"generate_custom_voice"):
        custom.generate_voice_design("Hello.", "A calm voice.")
    with pytest.raises(ValueError, match="generate_voice_clone needs a Base checkpoint.*use generate_voice_design"):
        design.generate_voice_clone("Hello.", ref_audio="x.wav", ref_text="x")
    with pytest.raises(ValueError, match="generate_custom_voice needs a CustomVoice checkpoint.*generate_voice_clone"):
        base.generate_custom_voice("Hello.", "ryan")
    with pytest.raises(ValueError, match="cannot clone voices"):
        custom.synthesize("Hello.", speaker="ryan", voice=Voice(None, torch.zeros(96), True, False))


def test_instruct_on_small_custom_voice_warns_and_is_dropped(custom_small, monkeypatch):
    specs = []
    original = q3tts.api.engine_host.build_prompts
    monkeypatch.setattr(q3tts.api.engine_host, "build_prompts", lambda t, c, s: specs.extend(s) or original(t, c, s))
    with pytest.warns(UserWarning, match="ignores `instruct`"):
        custom_small.generate_custom_voice("Hello.", "ryan", instruct="Speak slowly.", **FAST)
    assert specs[0].instruct_ids is None


@pytest.fixture
def built(monkeypatch) -> list:
    """The requests the drop-in methods build (nothing runs: each call returns no audio)."""
    requests = []
    monkeypatch.setattr(q3tts.api.render.Renderer, "render", lambda self, rs, **kw: requests.extend(rs) or [])
    return requests


def test_the_drop_in_reads_its_arguments_as_the_official_does(custom, custom_small, design, base, ref_wav, built):
    """Found against the official package (qwen-tts 0.1.1): non_streaming_mode=None feeds the text streaming (its
    `if non_streaming_mode:`; once the mode's default, True); a 0.6B CustomVoice drops `instruct` before any check;
    None in a language list, and 1-element ref_text / x_vector_only_mode lists for several references, are refused;
    eos_token_id is the codec's own or refused; max_new_tokens=1 is refused (the official fails in torch.stack; once
    empty audio here); a prompt item in neither x-vector nor in-context mode has no speaker position."""
    custom.generate_custom_voice("Hi.", "ryan", non_streaming_mode=None)
    custom.generate_custom_voice("Hi.", "ryan")
    design.generate_voice_design("Hi.", "A calm voice.", non_streaming_mode=None)
    assert [r.spec.non_streaming_mode for r in built] == [False, True, False]
    for instruct in (["a", "b", "c"], 5):
        with pytest.warns(UserWarning, match="ignores `instruct`"):
            custom_small.generate_custom_voice("Hi.", "ryan", instruct=instruct)
    assert built[-1].spec.instruct_ids is None
    with pytest.raises(RequestError, match="unsupported language None") as e:
        custom.generate_custom_voice(["Hi.", "Ho."], "ryan", language=[None, "english"])
    assert e.value.param == "language"
    for name, value in (("ref_text", ["Good morning."]), ("x_vector_only_mode", [True])):
        with pytest.raises(RequestError, match=f"2 reference audios but 1 values for {name}"):
            base.create_voice_clone_prompt([str(ref_wav)] * 2, **{name: value})
    eos = custom.config.talker_config.codec_eos_token_id
    custom.generate_custom_voice("Hi.", "ryan", eos_token_id=eos)
    with pytest.raises(RequestError, match=f"eos_token_id 5 is not supported: .* end token \\({eos}\\)"):
        custom.generate_custom_voice("Hi.", "ryan", eos_token_id=5)
    with pytest.raises(RequestError, match="max_new_tokens must be at least 2, got 1"):
        custom.generate_custom_voice("Hi.", "ryan", max_new_tokens=1)
    embedding = base.create_voice(str(ref_wav), x_vector_only=True).ref_spk_embedding
    neither = VoiceClonePromptItem(None, embedding, x_vector_only_mode=False, icl_mode=False)
    base.generate_voice_clone(["Hi.", "Ho."], voice_clone_prompt=[neither, Voice(None, embedding, True, False)])
    assert built[-2].spec.speaker_embedding is None and built[-1].spec.speaker_embedding is not None
    assert built[-1].num_positions == built[-2].num_positions + 1


def test_greedy_decoding_ignores_sampling_arguments_with_a_warning(custom, built):
    """A stage decoded greedily uses none of its sampling arguments: as transformers does (and so the official
    package), they are ignored with a warning and not checked (temperature=0 beside do_sample=False is no
    mistake); a stage that samples still refuses them."""
    with pytest.warns(UserWarning, match="`temperature`, `top_k`: used only when sampling, ignored with greedy"):
        custom.generate_custom_voice("Hi.", "ryan", do_sample=False, temperature=0.0, top_k=-1)
    with pytest.warns(UserWarning, match="`subtalker_temperature`: used only when sampling"):
        request = custom.request("Hi.", speaker="ryan", subtalker_dosample=False, subtalker_temperature=0)
    assert request.params.subtalker_temperature == custom.generation_config.subtalker_temperature
    params, defaults = built[0].params, custom.generation_config
    assert (params.temperature, params.top_k) == (defaults.temperature, defaults.top_k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        custom.generate_custom_voice("Hi.", "ryan", do_sample=False, subtalker_temperature=0.5)
        with pytest.raises(RequestError, match="temperature must be a finite number > 0"):
            custom.generate_custom_voice("Hi.", "ryan", temperature=0.0)


def test_reference_audio_errors(base, tmp_path, no_compute):
    with pytest.raises(ValueError, match="ref_text is required"):
        base.generate_voice_clone("Hello.", ref_audio=str(tmp_path / "x.wav"))
    with pytest.raises(AudioError):
        base.generate_voice_clone("Hello.", ref_audio=str(tmp_path / "missing.wav"), ref_text="hi")
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(24000, dtype=np.float32), 24000)
    with pytest.raises(AudioError, match="silent"):
        base.create_voice(str(silent), "hi")
    empty = tmp_path / "empty.wav"
    sf.write(empty, np.zeros(0, dtype=np.float32), 24000)
    with pytest.raises(AudioError, match="empty"):
        base.create_voice(str(empty), "hi")


def test_voice_for_another_model_size_is_refused(base, base_large, ref_wav, tmp_path, no_compute):
    voice = base_large.create_voice(str(ref_wav), "Good morning.")
    voice.save(tmp_path / "large.voice")
    with pytest.raises(ValueError, match="made for a 1.7B model.* this checkpoint is 0.6B"):
        base.synthesize("Hello.", voice=tmp_path / "large.voice")
    with pytest.raises(ValueError, match="an in-context voice needs reference codes and reference text"):
        base.synthesize("Hello.", voice=Voice(None, torch.zeros(64), False, True))


@pytest.mark.parametrize("change, message", [
    ({"ref_code": torch.full((10, 16), 2048)}, r"codes in \[2048, 2048\]; codec codes are 0..2047"),
    ({"ref_code": torch.full((10, 16), -1)}, r"codes in \[-1, -1\]"),
    ({"ref_code": torch.zeros(10, 8, dtype=torch.long)}, r"integer tensor \[frames, 16\].*shape \[10, 8\]"),
    ({"ref_code": torch.zeros(0, 16, dtype=torch.long)}, r"at least one frame"),
    ({"ref_code": torch.zeros(10, 16)}, r"integer tensor .*float32"),
    ({"ref_spk_embedding": torch.zeros(2, 32)}, r"float tensor \[64\] \(or \[1, 64\]\).*shape \[2, 32\]"),
    ({"ref_spk_embedding": torch.full((64,), float("nan"))}, "NaN or infinite"),
], ids=["code-too-large", "code-negative", "eight-groups", "no-frames", "float-codes", "2-D-embedding", "nan"])
def test_a_malformed_voice_is_refused_before_the_engine(base, ref_wav, change, message, no_compute):
    """A voice built or loaded by hand with codes beyond the codebook, the wrong shape or dtype, or a broken
    embedding is a request error: in the engine it failed every running stream (on a GPU an out-of-range code
    would fault the device itself)."""
    good = base.create_voice(str(ref_wav), "Good morning.")
    with pytest.raises(ValueError, match=message):
        base.synthesize("Hello.", voice=Voice(**{**vars(good), **change}))


# ---- voices and seeds -----------------------------------------------------------------------------------------

def test_voice_round_trip(base, ref_wav, tmp_path):
    voice = base.create_voice(str(ref_wav), "Good morning.")
    voice.save(tmp_path / "v.voice")
    loaded = Voice.load(tmp_path / "v.voice")
    assert torch.equal(loaded.ref_code, voice.ref_code) and loaded.ref_text == "Good morning."
    assert torch.equal(loaded.ref_spk_embedding, voice.ref_spk_embedding) and loaded.model_size == "0b6"
    a = base.synthesize("Hello.", voice=voice, seed=3, **FAST)
    b = base.synthesize("Hello.", voice=tmp_path / "v.voice", seed=3, **FAST)
    assert np.array_equal(a, b)
    xvec = base.create_voice(str(ref_wav), x_vector_only=True)
    xvec.save(tmp_path / "x.voice")
    assert Voice.load(tmp_path / "x.voice").ref_code is None
    (tmp_path / "junk.voice").write_bytes(b"not a voice")
    with pytest.raises(ValueError, match="not a q3tts voice file .*; a voice file comes from Voice.save"):
        Voice.load(tmp_path / "junk.voice")



def _voice_file(path: Path, meta: str) -> Path:
    save_file({"ref_spk_embedding": torch.zeros(64)}, path, metadata={"q3tts": meta})
    return path


@pytest.mark.parametrize("meta, message", [
    ('{"format": "q3tts.voice.v1"}', "a damaged voice file .*lacks or garbles x_vector_only_mode, icl_mode"),
    ("[1, 2]", r"not a q3tts voice file \(format None\)"),
    ('{"format": "q3tts.voice.v1", "x_vector_only_mode": true, "icl_mode": false, "model_size": [1]}',
     "garbles model_size"),
    ('{"format": "q3tts.voice.v2"}', r"a voice file of an unsupported version \(q3tts.voice.v2; this q3tts reads "
                                     r"q3tts.voice.v1\)"),
], ids=["no-modes", "a-list", "bad-size", "v2"])
def test_a_damaged_or_newer_voice_file_is_a_request_error(base, tmp_path, meta, message, no_compute):
    """(These raised KeyError and AttributeError, and a newer version was called not a voice file.)"""
    path = _voice_file(tmp_path / "v.voice", meta)
    for load in (lambda: Voice.load(path), lambda: base.synthesize("Hello.", voice=path)):
        with pytest.raises(q3tts.RequestError, match=message) as caught:
            load()
        assert caught.value.param == "voice" and str(path) in str(caught.value)


def test_a_missing_voice_file_is_a_request_error(base, tmp_path, no_compute):
    with pytest.raises(q3tts.RequestError, match="nope.voice: voice file not found") as caught:
        base.synthesize("Hello.", voice="nope.voice")
    assert (caught.value.param, caught.value.code) == ("voice", "not_found")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux): a folder no file can be made in")
def test_voice_save_names_the_path_it_cannot_write(tmp_path):
    """(safetensors' error named a temporary file of its own, not the path given.)"""
    voice = Voice(None, torch.zeros(64), True, False)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nodir/x.voice: cannot save the voice: the folder "):
        voice.save(tmp_path / "nodir" / "x.voice")
    with pytest.raises(OSError, match="^/proc/x.voice: cannot save the voice: No such file or directory$"):
        voice.save("/proc/x.voice")
    voice.save(tmp_path / "x.voice")
    assert Voice.load(tmp_path / "x.voice").x_vector_only_mode and [p.name for p in tmp_path.iterdir()] == ["x.voice"]

def test_seed_reproducible_and_independent_of_batch(custom):
    sample = {"max_new_tokens": 12, "seed": 11}
    one, _ = custom.generate_custom_voice("Hello world.", "ryan", **sample)
    again, _ = custom.generate_custom_voice("Hello world.", "ryan", **sample)
    batch, _ = custom.generate_custom_voice(["Thank you very much.", "Hello world."], ["eric", "ryan"], **sample)
    other, _ = custom.generate_custom_voice("Hello world.", "ryan", max_new_tokens=12, seed=12)
    assert np.array_equal(one[0], again[0])
    # Same codes; the batched codec decode may round differently in the last bits.
    assert one[0].shape == batch[1].shape and np.abs(one[0] - batch[1]).max() < 1e-5
    assert not np.array_equal(one[0], other[0])


def test_sampling_parameters_reach_the_sampler(custom):
    """Greedy ignores the seed; sampled output changes with temperature."""
    greedy = [custom.synthesize("Hello.", speaker="ryan", do_sample=False, subtalker_dosample=False, seed=s,
                                **FAST) for s in (1, 2)]
    assert np.array_equal(*greedy)
    hot = custom.synthesize("Hello.", speaker="ryan", temperature=5.0, seed=1, **FAST)
    cold = custom.synthesize("Hello.", speaker="ryan", temperature=0.05, seed=1, **FAST)
    assert not np.array_equal(hot, cold)


def test_synthesize_needs_the_right_voice_inputs(custom, design, base, no_compute):
    with pytest.raises(ValueError, match="needs `speaker`"):
        custom.synthesize("Hello.")
    with pytest.raises(ValueError, match="needs `instruct`"):
        design.synthesize("Hello.")
    with pytest.raises(ValueError, match="pass `voice`"):
        base.synthesize("Hello.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="needs a CustomVoice checkpoint"):
            design.synthesize("Hello.", speaker="ryan", instruct="calm")


def test_a_missing_transcript_names_the_reference_only_among_several(base, ref_wav):
    """One recording: the message says what is missing, with no index that means nothing to the caller (over HTTP
    there is one recording); a list: which of them."""
    with pytest.raises(RequestError, match=r"x_vector_only_mode=False\)$") as one:
        base.create_voice(str(ref_wav))
    assert one.value.param == "ref_text"
    with pytest.raises(RequestError, match="missing for reference 1"):
        base.create_voice_clone_prompt([str(ref_wav), str(ref_wav)], ref_text=["Good morning.", None])


def test_voice_clone_prompts_of_every_shape_or_a_clear_error(base, ref_wav, tmp_path, no_compute):
    """`voice_clone_prompt` takes create_voice_clone_prompt's list, a Voice, a voice file's path (once iterated as
    characters: "1 texts but 23 values"), or the official dict; a dict without its keys, of uneven lists or of
    scalars, and anything else, is a RequestError naming the argument (once a KeyError or IndexError)."""
    from q3tts.api.official import voices_from_prompt

    voice = base.create_voice(str(ref_wav), x_vector_only=True)
    path = tmp_path / "me.voice"
    voice.save(path)
    for prompt in (str(path), path, voice, [voice]):
        assert torch.equal(voices_from_prompt(prompt)[0].ref_spk_embedding, voice.ref_spk_embedding)
    spk = [voice.ref_spk_embedding]
    for prompt, match in ((dict(ref_spk_embedding=spk), "has no x_vector_only_mode, icl_mode"),
                          (dict(ref_spk_embedding=spk, x_vector_only_mode=[True, True], icl_mode=[False]),
                           "unequal length: 1 ref_spk_embedding but 2 x_vector_only_mode"),
                          (dict(ref_spk_embedding=spk, x_vector_only_mode=True, icl_mode=False), "needs lists"),
                          ([1, 2], "not int"), (3, "not int"), ([], "takes voices")):
        with pytest.raises(RequestError, match=match) as e:
            base.generate_voice_clone("Hi.", voice_clone_prompt=prompt)
        assert e.value.param == "voice_clone_prompt"


def test_native_inputs_of_the_wrong_kind_are_request_errors(base, ref_wav, no_compute):
    """A voice that is not one, texts where requests belong, a transcript that is not a string (once a voice that
    saved but never loaded), a max_new_tokens that leaves no audio, and a batch mismatch counted in what was
    given."""
    with pytest.raises(RequestTypeError, match="got ndarray"):
        base.synthesize("Hi.", voice=np.zeros(3))
    with pytest.raises(RequestTypeError, match="takes requests made by TTS.request, not str"):
        base.synthesize_all(["Hi."])
    with pytest.raises(RequestTypeError, match="ref_text must be a string") as e:
        base.create_voice(str(ref_wav), ref_text=123)
    assert e.value.param == "ref_text"
    voice = base.create_voice(str(ref_wav), x_vector_only=True)
    with pytest.raises(RequestError, match="max_new_tokens must be at least 2, got 1"):
        base.synthesize("Hi.", voice=voice, max_new_tokens=1)
    with pytest.raises(RequestError, match="2 reference audios but 3 values for ref_text"):
        base.create_voice_clone_prompt([str(ref_wav)] * 2, ref_text=["a", "b", "c"])
    for name, value in (("temperature", 1e39), ("repetition_penalty", 1e-46), ("subtalker_temperature", 1e-50)):
        with pytest.raises(RequestError, match=f"{name} must be a finite number > 0 that float32 holds") as e:
            base.synthesize("Hi.", voice=voice, **{name: value})  # (float32 makes them inf or 0: NaN scores)
        assert e.value.param == name
    loud = (1e30 * np.sin(np.arange(48000) / 20)).astype(np.float32)
    with pytest.raises(AudioError, match="speaker embedding with NaN or infinite values: its samples reach 1e"):
        base.create_voice((loud, 24000), x_vector_only=True)  # (once a voice stored, then refused at every use)


def test_an_interrupted_synthesize_frees_its_rows(custom):
    """Ctrl-C (any exception) while synthesize waits ends every request it submitted, even while the traceback,
    which holds them, is kept (as a REPL keeps sys.last_traceback)."""
    class Interrupt(BaseException):
        pass

    def interrupt(frames: int) -> None:
        if frames == 2:
            raise Interrupt

    requests = [custom.request(text, speaker="ryan", max_new_tokens=400, seed=7) for text in ("One.", "Two.", "Six.")]
    with pytest.raises(Interrupt) as caught:
        custom.synthesize_all(requests, on_frame=interrupt)
    deadline = time.monotonic() + 10
    while custom.engine.num_running or custom.engine.num_waiting:
        assert time.monotonic() < deadline, f"{custom.engine.num_running} rows still running after the interrupt"
        time.sleep(0.01)
    assert caught.value.__traceback__ is not None


def test_an_in_context_voice_whose_transcript_outruns_its_audio_counts_it_against_the_text_limit(base, ref_wav,
                                                                                                 no_compute):
    """In-context cloning trails the transcript's tokens beyond the reference's frames before the text: refused
    while the request is built, naming both counts, not later by the engine."""
    per_word = len(base.text_tokenizer.encode("word " * 100)) / 100
    voice = base.create_voice(ref_wav, "word " * 30)  # more tokens than the 1 s reference's 12-13 frames
    text = "word " * int(4090 / per_word)  # under the 4,096 alone
    with pytest.raises(RequestError, match=r"text \(\d+ tokens\) and the \d+ tokens of the voice's reference "
                                           r"transcript that run past its audio") as caught:
        base.request(text, voice=voice)
    assert caught.value.param == "text"
    base.request(text, voice=voice, non_streaming_mode=True)  # (nothing trails there)
    base.request("word " * int(4000 / per_word), voice=voice)

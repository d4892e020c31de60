"""End-to-end equivalence with the official qwen-tts package on tiny random checkpoints (fp32, greedy, CPU).

For every checkpoint type and mode the official API runs once (in its own virtual environment) and records
its prompt token ids, prefill inputs, raw talker and code-predictor logits, codes and audio; q3tts then runs
the same call and must give identical codes, the same audio (1e-5) and, fed the official token history,
the same logits (1e-5 relative).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

import q3tts.api
from q3tts import TTS
from q3tts.teacher_forcing import teacher_forced_logits
from q3tts.tiny import write_tiny_checkpoint
from tests.oracle.calls import audio_arg

GREEDY = {"do_sample": False, "subtalker_dosample": False}
TOL = 1e-5
LARGEST: dict[str, float] = {}  # largest difference seen per quantity, printed at the end of the run


def _seen(name: str, value: float) -> float:
    LARGEST[name] = max(LARGEST.get(name, 0.0), value)
    return value


def speech_like(seconds: float, sr: int, seed: int) -> np.ndarray:
    """Voiced harmonics under a syllable envelope plus noise (peak ~0.5): codes and x-vectors vary with it."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(110 + 40 * rng.random() + 15 * np.sin(2 * np.pi * 3 * t)) / sr
    tone = sum(np.sin(k * phase + rng.random() * 6) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.random() * 6) ** 2
    return (0.15 * tone * envelope + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


def call(method: str, **kwargs) -> dict:
    return {"method": method, "kwargs": {**kwargs, **GREEDY}}


# (checkpoint type, size, EOS row scale) -> calls. Reference audio: a file under the audio folder, passed as
# {"wav": name} (a path) or {"array": name} (an (array, sample rate) tuple; the official code breaks on stereo ones).
CASES: dict[str, tuple[str, str, float, list[dict]]] = {
    "custom-1b7": ("custom_voice", "1b7", 1.0, [
        call("generate_custom_voice", text="Hello world, it's a test.", speaker="Ryan", language="English",
             instruct="Speak slowly and warmly.", max_new_tokens=14),
        call("generate_custom_voice", text=["Hello world.", "你好世界 today is a good day, thank you."],
             speaker=["eric", "dylan"], language="auto", non_streaming_mode=False, max_new_tokens=12),
        call("generate_custom_voice", text="Good morning, seven bright stars.", speaker="dylan", language="chinese",
             non_streaming_mode=False, max_new_tokens=10),
        # No speaker (None or ""): the official code builds the prompt without a speaker position and with no
        # dialect tag, beside a row that has one.
        call("generate_custom_voice", text=["Hello world.", "Good morning, seven bright stars.", "Thank you."],
             speaker=[None, "", "eric"], language="auto", instruct="Speak slowly and warmly.", max_new_tokens=12),
    ]),
    "custom-0b6": ("custom_voice", "0b6", 1.0, [
        call("generate_custom_voice", text="The quick brown fox.", speaker="vivian", language="english",
             max_new_tokens=10),
        call("generate_custom_voice", text="Good morning, seven bright stars.", speaker=None, language="chinese",
             non_streaming_mode=False, max_new_tokens=10),
        # non_streaming_mode=None reads as False (the official's truth test); 0.6B drops any instruct unread.
        call("generate_custom_voice", text="Thank you very much.", speaker="ryan", instruct=["slowly", "fast", "x"],
             non_streaming_mode=None, max_new_tokens=8),
    ]),
    "design-1b7": ("voice_design", "1b7", 1.0, [
        call("generate_voice_design", text="Thank you very much.", instruct="A calm old man, whisper.",
             language="English", max_new_tokens=12),
        call("generate_voice_design", text=["One two three.", "Numbers: 42 and 3.14!"],
             instruct=["A young woman, excited.", ""], non_streaming_mode=False, max_new_tokens=10),
    ]),
    "base-0b6": ("base", "0b6", 1.0, [
        # A short reference: text positions outnumber reference frames (T1 > T2).
        call("generate_voice_clone", text="Hello world, this is a test of speech synthesis, please speak clearly.",
             language="English", ref_audio={"array": "short24k.wav"}, ref_text="Good morning.", max_new_tokens=12),
        # A longer 16 kHz stereo reference, resampled: T1 <= T2.
        call("generate_voice_clone", text="Thank you.", ref_audio={"wav": "long16k.wav"},
             ref_text="The quick brown fox jumps over a lazy dog.", max_new_tokens=10),
        call("generate_voice_clone", text="Thank you.", ref_audio={"wav": "long16k.wav"}, ref_text="A lazy dog.",
             non_streaming_mode=True, max_new_tokens=10),
        call("generate_voice_clone", text=["Good evening.", "One two three four five."], language="english",
             ref_audio=[{"wav": "short24k.wav"}, {"wav": "mid24k.wav"}], x_vector_only_mode=True,
             max_new_tokens=10),
        call("generate_voice_clone", text=["Good evening.", "Seven stars."],
             ref_audio=[{"wav": "short24k.wav"}, {"wav": "mid24k.wav"}], ref_text=["Good morning.", "Hello there."],
             max_new_tokens=10),
    ]),
    "base-1b7": ("base", "1b7", 1.0, [
        call("generate_voice_clone", text="Hello world.", ref_audio={"wav": "mid24k.wav"}, ref_text="Hello there.",
             language="english", max_new_tokens=10),
        call("generate_voice_clone", text="Hello world.", ref_audio={"wav": "mid24k.wav"}, x_vector_only_mode=True,
             max_new_tokens=10),
    ]),
    # EOS made likely, so that rows of a batch stop early at different frames.
    "custom-eos": ("custom_voice", "1b7", 40.0, [
        call("generate_custom_voice", text=["Hello.", "Good morning, seven bright stars shine.", "Thank you."],
             speaker=["ryan", "serena", "aiden"], language="english", max_new_tokens=40),
    ]),
}


@dataclass
class CaseSet:
    folder: Path
    calls: list[dict]
    oracle: list[dict] = field(default_factory=list)
    paths: dict[str, TTS] = field(default_factory=dict)  # "engine" (the default) and "reference" (the eager loop)

    def tts(self, path: str) -> TTS:
        if path not in self.paths:
            self.paths[path] = TTS.from_pretrained(self.folder, reference=path == "reference")
        return self.paths[path]


@pytest.fixture(scope="session")
def audio_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("audio")
    sf.write(folder / "short24k.wav", speech_like(0.5, 24000, 1), 24000)
    sf.write(folder / "mid24k.wav", speech_like(1.1, 24000, 2), 24000)
    long = np.stack([speech_like(2.3, 16000, 3), speech_like(2.3, 16000, 4)], axis=1)
    sf.write(folder / "long16k.wav", long, 16000, subtype="PCM_16")
    return folder


@pytest.fixture(scope="session")
def case_sets(tmp_path_factory, audio_dir, oracle):
    cache: dict[str, CaseSet] = {}

    def get(name: str) -> CaseSet:
        if name not in cache:
            kind, size, eos_scale, calls = CASES[name]
            folder = write_tiny_checkpoint(tmp_path_factory.mktemp(name), kind, size, seed=7)
            if eos_scale != 1.0:
                _scale_eos_row(folder, eos_scale)
            text = json.dumps(calls)
            for key in ("wav", "array"):
                text = text.replace(f'{{"{key}": "', f'{{"{key}": "{audio_dir}/')
            calls = json.loads(text)
            calls_path, out = folder / "calls.json", folder / "oracle.pt"
            calls_path.write_text(json.dumps(calls))
            oracle.run("generate.py", folder, calls_path, out)
            cache[name] = CaseSet(folder, calls, torch.load(out, weights_only=False))
        return cache[name]

    return get


def _scale_eos_row(folder: Path, scale: float) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["talker.codec_head.weight"][2150] *= scale
    save_file(tensors, path)


def _run_ours(tts: TTS, call_spec: dict, monkeypatch) -> dict:
    """Runs our drop-in method with the same arguments and records each row's spec, prompt and codes."""
    seen: dict = {"specs": [], "prompts": []}
    if tts.reference:
        original_generate, original_build = q3tts.api.generate_codes, q3tts.api.build_prompts

        def generate(talker, prompts, params, on_frame=None):
            seen["codes"] = original_generate(talker, prompts, params, on_frame)
            return seen["codes"]

        def build(talker, config, specs):
            seen["specs"] += specs
            seen["prompts"] += original_build(talker, config, specs)
            return seen["prompts"][-len(specs):]

        monkeypatch.setattr(q3tts.api, "generate_codes", generate)
        monkeypatch.setattr(q3tts.api, "build_prompts", build)
    else:
        streams, original_prepare, original_submit = [], TTS.prepare_many, TTS.submit

        def prepare(self, requests):
            seen["specs"] += [r.spec for r in requests]
            seen["prompts"] += original_prepare(self, requests)
            return seen["prompts"][-len(requests):]

        def submit(self, request, *args, **kwargs):
            streams.append(original_submit(self, request, *args, **kwargs))
            return streams[-1]

        monkeypatch.setattr(TTS, "prepare_many", prepare)
        monkeypatch.setattr(TTS, "submit", submit)
    kwargs = {k: audio_arg(v) for k, v in call_spec["kwargs"].items()}
    seen["wavs"], seen["sr"] = getattr(tts, call_spec["method"])(**kwargs)
    if not tts.reference:
        seen["codes"] = [torch.from_numpy(np.stack(s.channel.codes)) if s.channel.codes
                         else torch.zeros(0, 16, dtype=torch.long) for s in streams]
    return seen


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


ALL_CASES = [(name, i) for name, (_, _, _, calls) in CASES.items() for i in range(len(calls))]


@pytest.mark.filterwarnings("ignore:this 0.6B CustomVoice checkpoint ignores `instruct`")  # (a case asks so)
@pytest.mark.parametrize("path", ["engine", "reference"])
@pytest.mark.parametrize(("name", "index"), ALL_CASES, ids=[f"{n}-{i}" for n, i in ALL_CASES])
def test_matches_official(case_sets, name, index, path, monkeypatch):
    """Both of our paths through the public drop-in methods: the engine (what runs by default) and the eager
    reference loop."""
    cs = case_sets(name)
    ref = cs.oracle[index]
    tts = cs.tts(path)
    ours = _run_ours(tts, cs.calls[index], monkeypatch)
    B = len(ref["codes"])
    assert len(ours["codes"]) == B and ours["sr"] == ref["sr"] == 24000

    mask = ref["prefill"]["attention_mask"].bool()
    for b in range(B):
        prompt = ours["prompts"][b]
        # Prompt tokens and prefill inputs.
        spec = ours["specs"][b]
        assert spec.input_ids == ref["input_ids"][b][0].tolist()
        official_instruct = (ref["instruct_ids"] or [None] * B)[b]
        assert spec.instruct_ids == (official_instruct[0].tolist() if official_instruct is not None else None)
        official_ref = (ref["ref_ids"] or [None] * B)[b]
        assert spec.ref_ids == (official_ref[0].tolist() if official_ref is not None else None)
        official_embeds = ref["prefill"]["inputs_embeds"][b][mask[b]]
        assert prompt.embeds.shape == official_embeds.shape
        assert _seen("prefill embeddings (rel)", _rel(prompt.embeds, official_embeds)) < TOL
        trailing, n = ref["prefill"]["trailing_text_hidden"][b], prompt.trailing.shape[0]
        assert _rel(prompt.trailing, trailing[:n]) < TOL
        assert torch.equal(trailing[n:], prompt.pad.expand_as(trailing[n:]))  # padded with TTS_PAD

        # Free-running greedy codes are identical (frame count, EOS cut and all).
        codes = ref["codes"][b]
        assert ours["codes"][b].shape == codes.shape, f"row {b}: {ours['codes'][b].shape} vs {codes.shape}"
        assert torch.equal(ours["codes"][b], codes.cpu())

        # Teacher-forced logits, fed the official history.
        talker_logits, cp_logits = teacher_forced_logits(tts.model.talker, prompt, codes)
        official_talker = torch.stack([step[b] for step in ref["talker_logits"][:codes.shape[0] + 1]])
        assert _seen("talker logits, teacher-forced (rel)", _rel(talker_logits, official_talker)) < TOL
        official_cp = _official_cp_logits(ref["cp_logits"], b, codes.shape[0])
        assert _seen("code-predictor logits, teacher-forced (rel)", _rel(cp_logits, official_cp)) < TOL

        # Audio, including the official ICL cut of the reference's share.
        wav, official_wav = ours["wavs"][b], ref["wavs"][b].numpy()
        assert wav.shape == official_wav.shape
        assert _seen("audio (abs)", float(np.abs(wav - official_wav).max(initial=0.0))) < TOL
    if "items" in ref:
        _check_voice_items(tts, cs.calls[index], ref["items"])


def _official_cp_logits(records: list, row: int, num_frames: int) -> torch.Tensor:
    """The official run records head g's logits at every code-predictor step, 15 per frame, in order."""
    per_frame = [records[i:i + 15] for i in range(0, len(records), 15)][:num_frames]
    for frame in per_frame:
        assert [g for g, _ in frame] == list(range(15))
    return torch.stack([torch.stack([t[row] for _, t in frame]) for frame in per_frame])


def _check_voice_items(tts: TTS, call_spec: dict, items: list[dict]) -> None:
    kw = call_spec["kwargs"]
    voices = tts.create_voice_clone_prompt(audio_arg(kw["ref_audio"]), kw.get("ref_text"),
                                           kw.get("x_vector_only_mode", False))
    for voice, item in zip(voices, items):
        assert _seen("speaker embedding (rel)", _rel(voice.ref_spk_embedding, item["spk"])) < TOL
        if item["ref_code"] is None:
            assert voice.ref_code is None
        else:
            assert torch.equal(voice.ref_code, item["ref_code"].cpu())


def test_eos_case_exercises_early_stop(case_sets):
    """The EOS-heavy checkpoint must really stop rows early and at different frames (else the test is idle)."""
    lengths = [c.shape[0] for c in case_sets("custom-eos").oracle[0]["codes"]]
    assert min(lengths) < 39 and len(set(lengths)) > 1, lengths

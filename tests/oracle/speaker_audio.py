"""Official audio input path: loading, mono, librosa.resample, librosa.filters.mel and the official mel.

usage: speaker_audio.py DIR. DIR/cases.json lists the checks (see tests/test_audio.py); results go to
DIR/out.npz. Imports only the official package and its dependencies.
"""

import json
import sys
import types
from pathlib import Path

import librosa
import numpy as np
import torch
from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram
from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel
from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer


def official_normalize(source):
    # The loader methods use no instance state beyond each other, so an uninitialised instance runs them as is.
    model = Qwen3TTSModel.__new__(Qwen3TTSModel)
    return model._normalize_audio_inputs([source])[0]


def official_tokenizer_numpy(wav, sr, target_sr):
    tokenizer = Qwen3TTSTokenizer.__new__(Qwen3TTSTokenizer)
    tokenizer.feature_extractor = types.SimpleNamespace(sampling_rate=target_sr)
    return tokenizer._normalize_audio_inputs([wav], sr=sr)[0]


def official_24k(wav, sr):
    # create_voice_clone_prompt: resample to the speaker encoder's rate when it differs.
    if sr != 24000:
        wav = librosa.resample(y=wav.astype(np.float32), orig_sr=int(sr), target_sr=24000)
    return wav


def official_mel(wav):
    return mel_spectrogram(torch.from_numpy(wav), n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256,
                           win_size=1024, fmin=0, fmax=12000).transpose(1, 2).numpy()


def main(root: Path) -> None:
    cases = json.loads((root / "cases.json").read_text())
    out = {"filterbank": librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000)}
    for i, case in enumerate(cases["resample"]):
        y = np.load(root / case["input"])
        out[f"resample_{i}"] = librosa.resample(y, orig_sr=case["sr"], target_sr=case["target_sr"])
    for i, name in enumerate(cases["mel"]):
        out[f"mel_{i}"] = official_mel(np.load(root / name))
    tokenizer = Qwen3TTSTokenizer.__new__(Qwen3TTSTokenizer)
    for i, case in enumerate(cases["load"]):
        if case["kind"] == "tuple":
            source = (np.load(root / case["array"]), case["sr"])
        else:
            source = (root / case["text_file"]).read_text() if "text_file" in case else case["text"]
        try:
            wav, sr = official_normalize(source)
        except TypeError as e:
            # qwen_tts 0.1.1 crashes on 2-D (channels-last) tuples: it assigns into the (wav, sr) tuple. Record
            # that, and take the speech tokenizer's numpy route instead, which down-mixes them as intended.
            out[f"load_error_{i}"] = np.array(repr(e))
            wav, sr = official_tokenizer_numpy(*source, target_sr=source[1]), source[1]
        out[f"load_{i}"], out[f"load_sr_{i}"] = wav, np.array(sr)
        out[f"load24k_{i}"] = official_24k(wav, sr)
        if case["kind"] == "str":
            out[f"tokenizer24k_{i}"] = tokenizer.load_audio(source, target_sr=24000)
    np.savez(root / "out.npz", **out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

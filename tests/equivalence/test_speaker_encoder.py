"""ECAPA-TDNN speaker encoder: checkpoint names and loading, and x-vectors equal to the official model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from q3tts.checkpoint import load_tensors, module_shapes
from q3tts.config import SpeakerEncoderConfig
from q3tts.models.speaker_encoder import SpeakerEncoder, compute_speaker_embedding, min_num_samples
from q3tts.request.audio import AudioError, to_mono_24k
from q3tts.tiny.random_init import random_state_dict

TENSOR_NAMES = Path(__file__).resolve().parents[3] / "shared/reference/tensor-names"
CONFIGS = {
    "tiny": SpeakerEncoderConfig(enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8,
                                 enc_res2net_scale=4, enc_se_channels=8),
    # Even kernels (asymmetric "same" padding), a wide MFA kernel and Res2Net scale 8.
    "odd": SpeakerEncoderConfig(enc_dim=16, enc_channels=[24, 24, 24, 48], enc_kernel_sizes=[4, 2, 5, 3],
                                enc_dilations=[1, 3, 2, 2], enc_attention_channels=8, enc_res2net_scale=8,
                                enc_se_channels=4),
    "full": SpeakerEncoderConfig(enc_dim=1024),
}


def voice(num_samples: int, sr: int, seed: int) -> np.ndarray:
    """A speech-like float32 test signal (voiced harmonics, syllable envelope, noise), peak about 0.5."""
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / sr
    phase = 2 * np.pi * np.cumsum(100 + 60 * rng.random() + 20 * np.sin(2 * np.pi * 2.5 * t)) / sr
    tone = sum(np.sin(k * phase + rng.random() * 6) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.random() * 6) ** 2
    return (0.15 * tone * envelope + 0.02 * rng.standard_normal(num_samples)).astype(np.float32)


def random_encoder(config: SpeakerEncoderConfig, seed: int) -> SpeakerEncoder:
    encoder = SpeakerEncoder(config).eval()
    encoder.load_state_dict(random_state_dict(module_shapes(encoder), seed), strict=True)
    return encoder


def _rel_diff(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    diff = float(np.abs(ours - ref).max())
    return diff, diff / float(np.abs(ref).max())


def test_parameter_names_match_checkpoint():
    shapes = module_shapes(SpeakerEncoder(CONFIGS["full"]))
    assert len(shapes) == 76
    assert shapes["blocks.0.conv.weight"] == (512, 128, 5)
    assert shapes["blocks.3.res2net_block.blocks.6.conv.weight"] == (64, 64, 3)
    assert shapes["blocks.2.se_block.conv1.weight"] == (128, 512, 1)
    assert shapes["asp.tdnn.conv.weight"] == (128, 4608, 1)
    assert shapes["fc.weight"] == (1024, 3072, 1)
    for size, enc_dim in (("0.6B", 1024), ("1.7B", 2048)):
        listing = TENSOR_NAMES / f"keys_{size}-Base.txt"
        if not listing.exists():
            continue
        expected = {}
        for line in listing.read_text().splitlines():
            name, shape = line.split("\t")
            if name.startswith("speaker_encoder."):
                expected[name] = tuple(json.loads(shape))
        assert module_shapes(SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim)), "speaker_encoder.") == expected


def test_checkpoint_tensors_all_land_in_the_module(tmp_path):
    encoder = SpeakerEncoder(CONFIGS["tiny"])
    initial = {k: v.clone() for k, v in encoder.state_dict().items()}
    expected = module_shapes(encoder, "speaker_encoder.")
    stored = random_state_dict(expected, seed=7)
    save_file({**stored, "talker.codec_head.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    tensors = load_tensors(tmp_path / "model.safetensors", expected, ignored=[r"talker\..*"])
    encoder.load_state_dict({k.removeprefix("speaker_encoder."): v for k, v in tensors.items()}, strict=True)
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, stored[f"speaker_encoder.{name}"]), name
        assert not torch.equal(value, initial[name]), f"{name} kept its initial value"


def test_min_num_samples():
    assert min_num_samples(CONFIGS["full"]) == 1280  # dilation-4 kernel-3 convs reflect 4 frames each side
    assert min_num_samples(CONFIGS["odd"]) == 1280  # kernel 5 dilation 2: 4 frames
    encoder = random_encoder(CONFIGS["tiny"], seed=1)
    assert compute_speaker_embedding(encoder, voice(1280, 24000, 0)).shape == (32,)
    with pytest.raises(AudioError, match="too short.*1279 samples.*at least 1280"):
        compute_speaker_embedding(encoder, voice(1279, 24000, 0))
    with pytest.raises(AudioError, match="mono"):
        compute_speaker_embedding(encoder, np.zeros((2, 4000), np.float32))


def test_batch_equals_single_items():
    encoder = random_encoder(CONFIGS["tiny"], seed=2)
    mels = torch.randn(3, 50, 128) - 4
    with torch.inference_mode():
        batch = encoder(mels)
        single = torch.cat([encoder(mels[i : i + 1]) for i in range(3)])
    assert batch.shape == (3, 32)
    torch.testing.assert_close(batch, single, rtol=1e-5, atol=1e-6)


def test_runs_in_bfloat16():
    encoder = random_encoder(CONFIGS["tiny"], seed=3)
    wav = voice(12000, 24000, 4)
    ref = compute_speaker_embedding(encoder, wav)
    low = compute_speaker_embedding(encoder.to(torch.bfloat16), wav)
    assert low.dtype == torch.bfloat16
    assert (low.float() - ref).abs().max() <= 0.05 * ref.abs().max()


def test_embeddings_match_official(oracle, tmp_path):
    """Official mel + official Qwen3TTSSpeakerEncoder (our random weights, loaded strictly under our names)."""
    lengths = {"tiny": [1280, 5000, 60037], "odd": [1280, 7777], "full": [48000, 79999]}
    cases, ours = [], {}
    for c, (key, config) in enumerate(CONFIGS.items()):
        encoder = random_encoder(config, seed=10 + c)
        save_file(encoder.state_dict(), str(tmp_path / f"{key}.safetensors"))
        wavs = []
        for w, n in enumerate(lengths[key]):
            np.save(tmp_path / f"{key}_{w}.npy", voice(n, 24000, 100 * c + w))
            wavs.append(f"{key}_{w}.npy")
            ours[f"emb_{c}_{w}"] = compute_speaker_embedding(encoder, voice(n, 24000, 100 * c + w))
        if key == "full":  # a 16 kHz reference, resampled on each side as create_voice_clone_prompt does
            wav16 = voice(41000, 16000, 999)
            np.save(tmp_path / "full_16k.npy", wav16)
            wavs.append({"wav": "full_16k.npy", "sr": 16000})
            ours[f"emb_{c}_{len(wavs) - 1}"] = compute_speaker_embedding(encoder, to_mono_24k((wav16, 16000)))
        config_dict = {k: getattr(config, k) for k in config.__dataclass_fields__}
        cases.append({"config": config_dict, "weights": f"{key}.safetensors", "wavs": wavs})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    oracle.run("speaker_embedding.py", tmp_path)
    with np.load(tmp_path / "out.npz") as out:
        assert sorted(out.files) == sorted(ours)
        for name, emb in ours.items():
            abs_diff, rel_diff = _rel_diff(emb.numpy(), out[name])
            assert emb.shape == out[name].shape
            assert abs_diff <= 1e-5 and rel_diff <= 1e-5, (name, abs_diff, rel_diff)

"""A tiny random 12 Hz speech tokenizer in the official on-disk layout (loads in q3tts and in `qwen_tts`).

It keeps what the rest of the system depends on: 24 kHz, 12.5 Hz frames of 1920 samples (decoder
upsample_rates [8, 5, 4, 3] x upsampling_ratios [2, 2], encoder ratios [8, 6, 5, 4] then stride 2), 16 valid
codebooks of 2048 codes (the talker's code ids depend on it) and the encoder's 32 quantizers. Widths and depths
shrink. The decoder's sliding window is 16 frames: short inputs exercise the window mask, and over 4 layers it
reaches 60 frames back, beyond the 25 frames of context of the official 300-frame chunked decode, so that
approximation shows (~1e-3) as it does with the real model. The encoder's window (8) is never applied by the
official code (see q3tts/models/codec_encoder.py). Head count x head width differs from the hidden size in both
transformers, as in the real decoder.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint import instantiate
from ..config import SpeechTokenizerConfig
from ..models.codec_decoder import CodecDecoder
from ..models.speech_tokenizer import SpeechTokenizer
from .random_init import random_state_dict
from .shapes import TinyShape

TINY_SPEECH_TOKENIZER_CONFIG: dict = {
    "architectures": ["Qwen3TTSTokenizerV2Model"],
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": 24000,
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "encode_downsample_rate": 1920,
    "encoder_config": {
        "frame_rate": 12.5, "audio_channels": 1, "num_filters": 4, "kernel_size": 7, "residual_kernel_size": 3,
        "last_kernel_size": 3, "num_residual_layers": 1, "compress": 2, "upsampling_ratios": [8, 6, 5, 4],
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 16, "intermediate_size": 64, "hidden_act": "gelu", "norm_eps": 1e-05,
        "layer_scale_initial_scale": 0.01, "rope_theta": 10000, "max_position_embeddings": 8000,
        "sliding_window": 8, "num_quantizers": 32, "num_semantic_quantizers": 1, "codebook_size": 2048,
        "codebook_dim": 16, "vector_quantization_hidden_dimension": 16, "pad_mode": "constant",
        "use_causal_conv": True, "upsample_groups": 32, "dilation_growth_rate": 2, "use_conv_shortcut": False,
    },
    "decoder_config": {
        "attention_bias": False, "latent_dim": 48, "codebook_dim": 32, "codebook_size": 2048, "decoder_dim": 32,
        "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "layer_scale_initial_scale": 0.01,
        "max_position_embeddings": 8000, "head_dim": 16, "num_attention_heads": 4, "num_hidden_layers": 4,
        "num_key_value_heads": 4, "num_quantizers": 16, "num_semantic_quantizers": 1, "rms_norm_eps": 1e-05,
        "rope_theta": 10000, "semantic_codebook_size": 4096, "sliding_window": 16, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "vector_quantization_hidden_dimension": 32,
    },
    "transformers_version": "4.57.3",
}

PREPROCESSOR_CONFIG = {"chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor",
                       "feature_size": 1, "overlap": None, "padding_side": "right", "padding_value": 0.0,
                       "return_attention_mask": True, "sampling_rate": 24000}
CONFIGURATION = {"framework": "pytorch", "task": "feature-extraction", "allow_remote": True}

# Peak of the pre-clamp waveform for random codes after rescaling the last conv: well inside [-1, 1], so the
# final clamp never saturates and decoder differences stay visible.
TARGET_PEAK = 0.5


def write_tiny_speech_tokenizer(folder: Path, seed: int = 0, shape: TinyShape | None = None) -> Path:
    """Writes config.json, model.safetensors (fp32, every tensor of the official file, random),
    preprocessor_config.json and configuration.json to `folder` and returns it. `shape`: decoder sizes other than
    the built-in ones (`shape.codec`) and how the vocoder is conditioned (`shape.condition`)."""
    shape = shape or TinyShape()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG)
    data["decoder_config"].update(shape.codec)
    _write_json(folder / "config.json", data)
    config = SpeechTokenizerConfig.from_file(folder / "config.json")
    tensors = random_state_dict(SpeechTokenizer.checkpoint_shapes(config), seed)
    condition_vocoder(tensors, config, seed, per_block=shape.condition == "blocks")
    save_file(tensors, str(folder / "model.safetensors"))
    _write_json(folder / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    _write_json(folder / "configuration.json", CONFIGURATION)
    return folder


def condition_vocoder(tensors: dict[str, torch.Tensor], config: SpeechTokenizerConfig, seed: int,
                      per_block: bool = True) -> None:
    """Rescales (in place) each upsampling block's transposed conv so the block outputs rms 1 on random codes
    (unless `per_block` is False), then the last conv so the pre-clamp waveform peaks at TARGET_PEAK.

    Raw random weights grow the activations about 3x per block (rms ~35 before the last conv); through the
    Snake activations that turns fp32 rounding into ~3e-5 output differences between equal computations of
    different lengths (a prefix vs the whole), which would hide real errors at a 1e-5 tolerance.
    """
    decoder = _tiny_decoder(tensors, config)
    codes = torch.randint(0, config.decoder_config.codebook_size, (2, config.num_quantizers, 64),
                          generator=torch.Generator().manual_seed(seed)).to(decoder.pre_conv.conv.weight.device)
    blocks = list(decoder.decoder)
    with torch.inference_mode():
        hidden = blocks[0](decoder.features(codes))
        for i, block in enumerate(blocks[1:-2], start=1):
            if per_block:
                _scale(tensors, f"decoder.decoder.{i}.block.1.conv", block.block[1].conv, 1 / _rms(block(hidden)))
            hidden = block(hidden)
        peak = float(blocks[-1](blocks[-2](hidden)).abs().max())
    _scale(tensors, f"decoder.decoder.{len(blocks) - 1}.conv", blocks[-1].conv, TARGET_PEAK / peak)


def _tiny_decoder(tensors: dict[str, torch.Tensor], config: SpeechTokenizerConfig) -> CodecDecoder:
    with torch.device("meta"):
        names = set(CodecDecoder(config.decoder_config).state_dict())
    device = tensors["decoder.pre_conv.conv.weight"].device
    return instantiate(lambda: CodecDecoder(config.decoder_config),
                       {n: tensors["decoder." + n].clone() for n in names}, device).eval()


def _scale(tensors: dict[str, torch.Tensor], name: str, conv: torch.nn.Module, factor: float) -> None:
    """Multiplies a conv's weight and bias by `factor`, in the checkpoint tensors and in the live module."""
    for leaf in ("weight", "bias"):
        tensors[f"{name}.{leaf}"] *= factor
        with torch.no_grad():
            getattr(conv, leaf).mul_(factor)


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

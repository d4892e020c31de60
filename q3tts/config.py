"""Typed configuration parsed once from a checkpoint's JSON files.

`config.json` (model), `generation_config.json` and `speech_tokenizer/config.json` are read here and nowhere
else. Every field the code uses is a typed attribute; values the official config classes leave to their
defaults are filled in with those defaults (for the speaker encoder and the codec they are the real values).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from .errors import RequestError

MODEL_TYPES = ("base", "custom_voice", "voice_design")
MODEL_SIZES = ("0b6", "1b7")


class ConfigError(ValueError):
    """A config file is missing, unreadable, or holds a value this implementation cannot run."""


def _from_dict(cls, data: dict[str, Any], where: str):
    """Builds dataclass `cls` from `data`, taking only the fields it declares.

    Fields without a default must be present; unknown keys are ignored (the official files carry many
    keys that do not matter for inference, such as `initializer_range`).
    """
    kwargs = {}
    for f in fields(cls):
        if not f.init:
            continue
        if f.name in data:
            kwargs[f.name] = data[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{where}: required key {f.name!r} is missing")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e


def _check_positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class CodePredictorConfig:
    """The 5-layer decoder that predicts codebooks 1..15 of a frame (`talker_config.code_predictor_config`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int = 2048
    num_code_groups: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    attention_bias: bool = False

    def __post_init__(self):
        _check_positive(self, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "num_code_groups")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        self.rope_theta = float(self.rope_theta)


@dataclass
class TalkerConfig:
    """The Qwen3 decoder that predicts codebook 0 of each frame (`config.json: talker_config`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    text_vocab_size: int
    text_hidden_size: int
    code_predictor_config: CodePredictorConfig
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_token_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    num_code_groups: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = False
    codec_language_id: dict[str, int] = field(default_factory=dict)
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.code_predictor_config, dict):
            self.code_predictor_config = _from_dict(
                CodePredictorConfig, self.code_predictor_config, "talker_config.code_predictor_config")
        _check_positive(self, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "text_vocab_size", "text_hidden_size",
                        "num_code_groups", "max_position_embeddings")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.code_predictor_config.num_code_groups != self.num_code_groups:
            raise ValueError("talker and code predictor disagree on num_code_groups")
        self.rope_theta = float(self.rope_theta)
        # M-RoPE with three identical position rows is plain 1-D RoPE, so the sections only need to cover
        # exactly half the head dimension.
        sections = (self.rope_scaling or {}).get("mrope_section")
        if sections is not None and sum(sections) != self.head_dim // 2:
            raise ValueError(f"rope_scaling.mrope_section {sections} does not cover head_dim/2")
        self.codec_language_id = {k.lower(): int(v) for k, v in self.codec_language_id.items()}
        # Sources disagree on whether speaker ids are stored as 3066 or [3066]; both mean the same row.
        self.spk_id = {k.lower(): int(v[0] if isinstance(v, (list, tuple)) else v) for k, v in self.spk_id.items()}
        self.spk_is_dialect = {k.lower(): v for k, v in self.spk_is_dialect.items()}
        for name, dialect in self.spk_is_dialect.items():
            if dialect and dialect not in self.codec_language_id:
                raise ValueError(f"speaker {name!r} names dialect {dialect!r}, which has no codec language id")
        special = [self.codec_pad_id, self.codec_bos_id, self.codec_eos_token_id, self.codec_think_id,
                   self.codec_nothink_id, self.codec_think_bos_id, self.codec_think_eos_id,
                   *self.codec_language_id.values(), *self.spk_id.values()]
        bad = [i for i in special if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"codec ids {bad} are outside the codec vocabulary of {self.vocab_size}")

    @property
    def num_codes(self) -> int:
        """Size of one codebook (ids 0..num_codes-1 of the talker vocabulary are codebook-0 codes)."""
        return self.code_predictor_config.vocab_size


@dataclass
class SpeakerEncoderConfig:
    """ECAPA-TDNN speaker encoder (Base checkpoints). Defaults are the official class defaults, which the
    released files rely on (they store only `enc_dim` and `sample_rate`)."""

    enc_dim: int = 1024
    mel_dim: int = 128
    enc_channels: list[int] = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list[int] = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    def __post_init__(self):
        if not len(self.enc_channels) == len(self.enc_kernel_sizes) == len(self.enc_dilations):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        _check_positive(self, "enc_dim", "mel_dim", "enc_attention_channels", "enc_res2net_scale",
                        "enc_se_channels", "sample_rate")


@dataclass
class ModelConfig:
    """A Qwen3-TTS checkpoint's `config.json`."""

    tts_model_type: str
    tts_model_size: str
    talker_config: TalkerConfig
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    assistant_token_id: int = 77091
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
    model_type: str = "qwen3_tts"
    speaker_encoder_config: SpeakerEncoderConfig | None = None

    def __post_init__(self):
        if self.model_type != "qwen3_tts":
            raise ValueError(f"model_type {self.model_type!r} is not a Qwen3-TTS model ('qwen3_tts')")
        if self.tts_model_type not in MODEL_TYPES:
            raise ValueError(f"tts_model_type {self.tts_model_type!r} is not one of {MODEL_TYPES}")
        if self.tokenizer_type != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"tokenizer_type {self.tokenizer_type!r} is not supported (only the 12 Hz codec)")
        if isinstance(self.talker_config, dict):
            self.talker_config = _from_dict(TalkerConfig, self.talker_config, "talker_config")
        if isinstance(self.speaker_encoder_config, dict):
            self.speaker_encoder_config = _from_dict(
                SpeakerEncoderConfig, self.speaker_encoder_config, "speaker_encoder_config")
        if self.speaker_encoder_config is None:
            self.speaker_encoder_config = SpeakerEncoderConfig(enc_dim=self.talker_config.hidden_size)
        if self.is_base and self.speaker_encoder_config.enc_dim != self.talker_config.hidden_size:
            raise ValueError("speaker_encoder_config.enc_dim must equal the talker hidden size")
        for name in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
            if not 0 <= getattr(self, name) < self.talker_config.text_vocab_size:
                raise ValueError(f"{name} is outside the text vocabulary")

    @property
    def is_base(self) -> bool:
        return self.tts_model_type == "base"

    @property
    def supports_instruct(self) -> bool:
        """The official API drops custom-voice instructions on 0.6B (`tts_model_size in "0b6"`)."""
        return self.tts_model_type == "voice_design" or (
            self.tts_model_type == "custom_voice" and self.tts_model_size not in "0b6")

    @property
    def supported_languages(self) -> list[str]:
        """Sorted, lower-case, with "auto"; dialects are reached through speakers, not named directly."""
        return sorted(["auto"] + [k for k in self.talker_config.codec_language_id if "dialect" not in k])

    @property
    def supported_speakers(self) -> list[str]:
        return sorted(self.talker_config.spk_id)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return _from_dict(cls, read_json(path), str(path))


@dataclass
class GenerationConfig:
    """Sampling defaults (`generation_config.json`); an explicit argument always wins over these."""

    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    # The official wrapper's hard default when the file lacks the key; the released file says 8192.
    max_new_tokens: int = 2048

    @classmethod
    def from_file(cls, path: str | Path | None) -> GenerationConfig:
        """The file's defaults, checked as a request's arguments are (a bad value is the checkpoint's error, not
        a later request's)."""
        if path is None or not Path(path).exists():
            return cls()
        config = _from_dict(cls, read_json(path), str(path))
        try:
            check_generation_values(config)
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
        return config


FLOAT32_SMALLEST, FLOAT32_MAX = 2.0**-149, 3.4028234663852886e38  # the positive float32 range


def check_generation_values(config: GenerationConfig) -> None:
    """The range rule of every generation value, for a checkpoint's defaults and a request's arguments
    (`SamplingParams`) alike: raises RequestError naming the field at fault."""
    for prefix in ("", "subtalker_"):
        for name in ("temperature", "top_k", "top_p"):
            _check(config, prefix + name)
    for name in ("repetition_penalty", "max_new_tokens", "do_sample", "subtalker_dosample"):
        _check(config, name)


def is_int(value: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check(params: GenerationConfig, name: str) -> None:
    """Raises RequestError naming `name` if its value is out of range."""
    value, base = getattr(params, name), name.removeprefix("subtalker_")
    if base in ("do_sample", "dosample"):
        ok, rule = isinstance(value, (bool, np.bool_)) or (is_int(value) and value in (0, 1)), "must be True or False"
    elif base == "top_k":
        ok, rule = is_int(value) and value >= 0, "must be an integer >= 0 (0 disables it)"
    elif base == "top_p":
        ok, rule = _is_number(value) and 0.0 < value <= 1.0, "must be in (0, 1]"
    elif base == "temperature" or base == "repetition_penalty":  # (divisors in float32: neither 0 nor inf there)
        ok = _is_number(value) and FLOAT32_SMALLEST <= value <= FLOAT32_MAX
        rule = "must be a finite number > 0" + (" that float32 holds (1.4e-45 to 3.4e38)" if not ok and
                                                 _is_number(value) and value > 0 else "")
    else:  # max_new_tokens
        ok, rule = is_int(value) and value >= 1, "must be a positive integer"
    if not ok:
        switch = "subtalker_dosample" if name.startswith("subtalker_") else "do_sample"
        hint = f" (use {switch}=False for greedy decoding)" if base == "temperature" else ""
        raise RequestError(f"{name} {rule}, got {value!r}{hint}", param=name)



@dataclass
class CodecEncoderConfig:
    """The Mimi encoder inside the speech tokenizer (`speech_tokenizer/config.json: encoder_config`)."""

    hidden_size: int = 512
    num_filters: int = 64
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    num_residual_layers: int = 1
    dilation_growth_rate: int = 2
    compress: int = 2
    upsampling_ratios: list[int] = field(default_factory=lambda: [8, 6, 5, 4])
    audio_channels: int = 1
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2048
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 250
    max_position_embeddings: int = 8000
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    codebook_size: int = 2048
    codebook_dim: int = 256
    frame_rate: float = 12.5
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    use_conv_shortcut: bool = False
    layer_scale_initial_scale: float = 0.01

    def __post_init__(self):
        if not self.use_causal_conv:
            raise ValueError("only causal codec encoders are supported")
        if self.use_conv_shortcut:
            raise ValueError("use_conv_shortcut is not supported")
        _check_positive(self, "hidden_size", "num_filters", "num_hidden_layers", "num_attention_heads", "head_dim",
                        "num_quantizers", "codebook_size", "codebook_dim")


@dataclass
class CodecDecoderConfig:
    """The speech tokenizer's decoder, codes -> 24 kHz audio (`speech_tokenizer/config.json: decoder_config`)."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    latent_dim: int = 1024
    decoder_dim: int = 1536
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72
    max_position_embeddings: int = 8000
    layer_scale_initial_scale: float = 0.01
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    attention_bias: bool = False

    def __post_init__(self):
        _check_positive(self, "codebook_size", "codebook_dim", "latent_dim", "decoder_dim", "hidden_size",
                        "intermediate_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                        "sliding_window", "num_quantizers")
        if self.hidden_act != "silu":
            raise ValueError(f"decoder hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in [*self.upsampling_ratios, *self.upsample_rates]:
            n *= r
        return n


@dataclass
class SpeechTokenizerConfig:
    """`speech_tokenizer/config.json` (the 12 Hz codec, `Qwen3-TTS-Tokenizer-12Hz`)."""

    encoder_config: CodecEncoderConfig = field(default_factory=CodecEncoderConfig)
    decoder_config: CodecDecoderConfig = field(default_factory=CodecDecoderConfig)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920
    model_type: str = "qwen3_tts_tokenizer_12hz"

    def __post_init__(self):
        if self.model_type != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"speech tokenizer model_type {self.model_type!r} is not supported")
        if isinstance(self.encoder_config, dict):
            self.encoder_config = _from_dict(CodecEncoderConfig, self.encoder_config, "encoder_config")
        if isinstance(self.decoder_config, dict):
            self.decoder_config = _from_dict(CodecDecoderConfig, self.decoder_config, "decoder_config")
        if self.decoder_config.samples_per_frame != self.decode_upsample_rate:
            raise ValueError(
                f"decoder upsampling gives {self.decoder_config.samples_per_frame} samples per frame, "
                f"decode_upsample_rate says {self.decode_upsample_rate}")
        if self.encoder_valid_num_quantizers != self.decoder_config.num_quantizers:
            raise ValueError("encoder_valid_num_quantizers must equal decoder num_quantizers")

    @property
    def num_quantizers(self) -> int:
        return self.decoder_config.num_quantizers

    @property
    def frame_rate(self) -> float:
        return self.output_sample_rate / self.decode_upsample_rate

    @classmethod
    def from_file(cls, path: str | Path) -> SpeechTokenizerConfig:
        return _from_dict(cls, read_json(path), str(path))


def read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data

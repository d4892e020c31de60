"""Tiny random checkpoints in the official on-disk layout, for tests and smoke runs. They produce noise.

`write_tiny_checkpoint(folder, "custom_voice")` writes config.json, generation_config.json,
model.safetensors, the text tokenizer files and speech_tokenizer/ exactly as a released checkpoint lays
them out, so both q3tts and the official package load them. The shapes keep what matters structurally:
talker head_dim x heads != hidden, a text width that differs from the talker width (exercises the text
projection), a code predictor narrower than the talker ("1b7": exercises small_to_mtp_projection) or as wide
("0b6": Identity), the official codec ids (codebook size 2048) and the 12.5 Hz codec ratios. A `TinyShape`
(`q3tts.tiny.shapes`) changes the sizes, e.g. to one drawn at random within the official families.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file

from ..config import MODEL_TYPES, ModelConfig
from .random_init import random_state_dict
from .shapes import TinyShape, mrope_section
from .speech_tokenizer import write_tiny_speech_tokenizer
from .text_tokenizer import write_tiny_text_tokenizer

TINY_NAMES = {"tiny": ("custom_voice", "1b7"), "tiny-custom-voice": ("custom_voice", "1b7"),
              "tiny-custom-voice-0.6b": ("custom_voice", "0b6"), "tiny-base": ("base", "0b6"),
              "tiny-base-1.7b": ("base", "1b7"), "tiny-voice-design": ("voice_design", "1b7")}
FORMAT_VERSION = 1  # bump when the tiny layout changes, so cached copies are rebuilt

SPEAKERS = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
            "sohee": 2864, "eric": 2875, "dylan": 2878}
DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
             "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069}
GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
                     "subtalker_top_k": 50, "max_new_tokens": 8192}


def tiny_config(model_type: str, size: str, text_ids: dict[str, int], shape: TinyShape | None = None) -> dict:
    """config.json contents of a tiny checkpoint (the official key layout, small dimensions; `shape` overrides
    the built-in sizes)."""
    if model_type not in MODEL_TYPES or size not in ("0b6", "1b7"):
        raise ValueError(f"unknown tiny model {model_type!r}/{size!r}")
    shape = shape or TinyShape()
    hidden = shape.talker.get("hidden_size", 64 if size == "0b6" else 96)
    languages = dict(LANGUAGES)
    if model_type == "custom_voice":
        languages.update(beijing_dialect=2074, sichuan_dialect=2062)
    talker = {
        "vocab_size": 3072, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default", "type": "default"},
        "attention_bias": False, "num_code_groups": 16, "text_hidden_size": 80,
        "text_vocab_size": text_ids["text_vocab_size"], "position_id_per_seconds": 13,
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
            "attention_bias": False, "num_code_groups": 16, "max_length": 20, **shape.code_predictor},
        "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148, "codec_think_id": 2154,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_language_id": languages, **shape.talker,
        "spk_id": SPEAKERS if model_type == "custom_voice" else {},
        "spk_is_dialect": {s: DIALECTS.get(s, False) for s in SPEAKERS} if model_type == "custom_voice" else {},
    }
    talker["rope_scaling"]["mrope_section"] = mrope_section(talker["head_dim"])
    cp_hidden = talker["code_predictor_config"]["hidden_size"]
    if (cp_hidden == hidden) != (size == "0b6"):
        raise ValueError(f"the {size} layout's code predictor is {'as wide as' if size == '0b6' else 'narrower than'} "
                         f"the talker: hidden sizes {cp_hidden} and {hidden}")
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": size, "tts_model_type": model_type,
        **{k: v for k, v in text_ids.items() if k != "text_vocab_size"}, "talker_config": talker,
        "transformers_version": "4.57.3",
    }
    if model_type == "base":
        config["speaker_encoder_config"] = {
            "enc_dim": hidden, "sample_rate": 24000, "mel_dim": 128, "enc_channels": [32, 32, 32, 32, 96],
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1], "enc_attention_channels": 16,
            "enc_res2net_scale": 4, "enc_se_channels": 16}
    return config


def write_tiny_checkpoint(folder: str | Path, model_type: str = "custom_voice", size: str = "1b7",
                          seed: int = 0, shape: TinyShape | None = None) -> Path:
    """Writes a complete random checkpoint to `folder` and returns it (`shape`: sizes other than the built-in
    ones, see `TinyShape`)."""
    from ..models.qwen3_tts import Qwen3TTSModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text_ids = write_tiny_text_tokenizer(folder)
    config = tiny_config(model_type, size, text_ids, shape)
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", GENERATION_CONFIG)
    _write_json(folder / "preprocessor_config.json", {"processor_class": "Qwen3TTSProcessor"})
    shapes = Qwen3TTSModel.checkpoint_shapes(ModelConfig.from_file(folder / "config.json"))
    save_file(random_state_dict(shapes, seed), str(folder / "model.safetensors"))
    write_tiny_speech_tokenizer(folder / "speech_tokenizer", seed=seed, shape=shape)
    return folder


def tiny_checkpoint(name: str, cache_dir: Path | None = None) -> Path:
    """The built-in tiny model `name` (see TINY_NAMES), written once into the q3tts cache folder."""
    if name not in TINY_NAMES:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(TINY_NAMES)}")
    model_type, size = TINY_NAMES[name]
    root = cache_dir or Path(os.environ.get("Q3TTS_CACHE", Path.home() / ".cache" / "q3tts"))
    folder = root / f"{name}-v{FORMAT_VERSION}"
    if not (folder / ".complete").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        write_tiny_checkpoint(tmp, model_type, size)
        (tmp / ".complete").touch()
        if folder.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.replace(folder)
    return folder


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

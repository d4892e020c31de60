"""Full-size models with random weights, for speed measurements and faithfulness checks without real weights.

Speed does not depend on weight values; the real configs (`q3tts/configs/`, the released `config.json`
values) give the real shapes. With `disable_eos` the EOS row of the codebook-0 head is zeroed, so EOS never
wins and every run lasts exactly `max_new_tokens` steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import instantiate
from ..config import ModelConfig
from ..models.qwen3_tts import Qwen3TTSModel
from ..tiny.random_init import random_state_dict

CONFIG_DIR = Path(__file__).parent.parent / "configs"
MODEL_NAMES = ("0.6B-Base", "0.6B-CustomVoice", "1.7B-Base", "1.7B-CustomVoice", "1.7B-VoiceDesign")


def model_config(name: str) -> ModelConfig:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")
    return ModelConfig.from_file(CONFIG_DIR / f"{name}.json")


def random_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 disable_eos: bool = True) -> Qwen3TTSModel:
    config = model_config(name)
    tensors = random_state_dict(Qwen3TTSModel.checkpoint_shapes(config), seed, device=device, dtype=dtype)
    model = instantiate(lambda: Qwen3TTSModel(config), tensors, device).eval()
    if disable_eos:
        model.talker.codec_head.weight.data[config.talker_config.codec_eos_token_id] = 0
    return model


def random_prompt_ids(config: ModelConfig, num_text_tokens: int, seed: int = 0) -> list[int]:
    """`<|im_start|>assistant\\n` + random text ids + the 5-token tail, as the prompt builder expects."""
    g = torch.Generator().manual_seed(seed)
    high = min(100_000, config.im_start_token_id)  # ordinary text ids, below the special tokens
    text = torch.randint(high // 2, high, (num_text_tokens,), generator=g).tolist()
    start, end, newline = config.im_start_token_id, config.im_end_token_id, 198
    return [start, config.assistant_token_id, newline, *text, end, newline, start, config.assistant_token_id, newline]

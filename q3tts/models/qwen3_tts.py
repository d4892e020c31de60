"""The whole Qwen3-TTS language model as stored in `model.safetensors`: the talker (with its code predictor)
and, for Base checkpoints, the speaker encoder."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..checkpoint import instantiate, load_tensors, module_shapes
from ..config import ModelConfig
from .lora import merge_lora
from .speaker_encoder import SpeakerEncoder
from .talker import Talker


class Qwen3TTSModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker_config)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder_config) if config.is_base else None

    @staticmethod
    def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of the official `model.safetensors` for this config (all of them are used)."""
        with torch.device("meta"):
            return module_shapes(Qwen3TTSModel(config))

    @classmethod
    def from_folder(cls, folder: Path, config: ModelConfig, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, lora: Path | None = None) -> Qwen3TTSModel:
        """`lora`: a PEFT LoRA adapter's folder, merged into the weights as they load (lora.py)."""
        tensors = load_tensors(folder / "model.safetensors", cls.checkpoint_shapes(config), dtype=dtype)
        if lora is not None:
            merge_lora(tensors, lora)
        return instantiate(lambda: cls(config), tensors, device).eval()

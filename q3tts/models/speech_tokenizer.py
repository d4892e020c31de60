"""The 12 Hz speech tokenizer (`Qwen3-TTS-Tokenizer-12Hz`): waveform <-> 16 codes per 80 ms frame.

Loads `speech_tokenizer/{config.json, model.safetensors}` unchanged. Every tensor of the file is either
loaded into `encoder`/`decoder` or matched by `ignored_patterns` (tensors inference never reads); anything
else, missing or misshapen is a `CheckpointError`.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checkpoint import instantiate, load_tensors, module_shapes
from ..config import SpeechTokenizerConfig
from . import codec_decoder, codec_encoder
from .codec_decoder import CodecDecoder
from .codec_encoder import CodecEncoder


def ignored_patterns(config: SpeechTokenizerConfig, load_encoder: bool = True) -> list[str]:
    """Regular expressions (full match) for the file's tensors that are deliberately not loaded."""
    patterns = [r"decoder\." + p for p in codec_decoder.IGNORED_TENSORS]
    if not load_encoder:
        return [*patterns, r"encoder\..*"]
    encoder = codec_encoder.ignored_patterns(config.encoder_config, config.encoder_valid_num_quantizers)
    return patterns + [r"encoder\." + p for p in encoder]


class SpeechTokenizer(nn.Module):
    """`encoder` (waveform -> codes; None when loaded without it) and `decoder` (codes -> waveform)."""

    def __init__(self, config: SpeechTokenizerConfig, load_encoder: bool = True):
        super().__init__()
        self.config = config
        self.encoder = CodecEncoder(config.encoder_config, config.encoder_valid_num_quantizers) \
            if load_encoder else None
        self.decoder = CodecDecoder(config.decoder_config)
        if load_encoder and self.encoder.samples_per_frame != config.encode_downsample_rate:
            raise ValueError(f"the encoder makes a frame of {self.encoder.samples_per_frame} samples, "
                             f"encode_downsample_rate says {config.encode_downsample_rate}")

    @property
    def sample_rate(self) -> int:
        return self.config.output_sample_rate

    @property
    def samples_per_frame(self) -> int:
        return self.config.decode_upsample_rate

    @staticmethod
    def checkpoint_shapes(config: SpeechTokenizerConfig) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor the official `model.safetensors` holds for `config`, used or not."""
        with torch.device("meta"):
            shapes = module_shapes(SpeechTokenizer(config, load_encoder=True))
        n_valid = config.encoder_valid_num_quantizers
        shapes.update({"encoder." + k: v
                       for k, v in codec_encoder.ignored_shapes(config.encoder_config, n_valid).items()})
        shapes.update({"decoder." + k: v for k, v in codec_decoder.ignored_shapes(config.decoder_config).items()})
        return shapes

    @classmethod
    def from_pretrained(cls, folder: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        load_encoder: bool = True) -> SpeechTokenizer:
        """Reads `folder/config.json` and `folder/model.safetensors`; `load_encoder=False` skips the encoder
        (only Base checkpoints encode reference audio)."""
        folder = Path(folder)
        config = SpeechTokenizerConfig.from_file(folder / "config.json")
        with torch.device("meta"):
            expected = module_shapes(cls(config, load_encoder))
        tensors = load_tensors(folder / "model.safetensors", expected, ignored_patterns(config, load_encoder),
                               dtype=dtype)
        return instantiate(lambda: cls(config, load_encoder), tensors, device).eval()

    @torch.inference_mode()
    def encode(self, wavs: list[np.ndarray]) -> list[torch.Tensor]:
        """float32 mono waveforms at 24 kHz -> codes [ceil(n / 1920), 16] (int64, CPU) per item.

        Like the official `Qwen3TTSTokenizer.encode`, the items are encoded as one right-zero-padded batch and
        trimmed afterwards, so the last frame of a shorter item can differ from encoding it alone.
        """
        if self.encoder is None:
            raise RuntimeError("this SpeechTokenizer was loaded without its encoder (load_encoder=False)")
        if not wavs:
            return []
        arrays = [np.asarray(w, dtype=np.float32) for w in wavs]
        for i, a in enumerate(arrays):
            if a.ndim != 1 or a.shape[0] == 0:
                raise ValueError(f"item {i}: expected a non-empty 1-D mono waveform, got shape {a.shape}")
        device = self.decoder.pre_conv.conv.weight.device
        dtype = self.decoder.pre_conv.conv.weight.dtype
        batch = torch.zeros(len(arrays), 1, max(a.shape[0] for a in arrays), dtype=dtype, device=device)
        for i, a in enumerate(arrays):
            batch[i, 0, : a.shape[0]] = torch.from_numpy(a).to(dtype)
        codes = self.encoder(batch)  # [B, 16, T]
        step = self.config.encode_downsample_rate
        return [codes[i, :, : -(-a.shape[0] // step)].T.cpu() for i, a in enumerate(arrays)]

    @torch.inference_mode()
    def decode(self, codes: list[torch.Tensor]) -> list[np.ndarray]:
        """codes [T, 16] per item -> float32 waveform of exactly T * 1920 samples per item.

        Exact whole-sequence decoding of a right-padded batch (the decoder is causal, so padding never
        reaches the kept samples). Unlike the official 300-frame chunked decode this is exact beyond 300
        frames too.
        """
        if not codes:
            return []
        device = self.decoder.pre_conv.conv.weight.device
        num_q = self.config.num_quantizers
        for i, c in enumerate(codes):
            if c.ndim != 2 or c.shape[1] != num_q:
                raise ValueError(f"item {i}: expected codes [T, {num_q}], got {list(c.shape)}")
        lengths = [int(c.shape[0]) for c in codes]
        batch = torch.zeros(len(codes), num_q, max(lengths), dtype=torch.long, device=device)
        for i, c in enumerate(codes):
            batch[i, :, : lengths[i]] = torch.as_tensor(c).to(device=device, dtype=torch.long).T
        if max(lengths) == 0:
            return [np.zeros(0, dtype=np.float32) for _ in codes]
        wav = self.decoder(batch)[:, 0].float().cpu().numpy()  # [B, max_T * 1920]
        step = self.samples_per_frame
        return [np.ascontiguousarray(wav[i, : n * step]) for i, n in enumerate(lengths)]


def is_ignored(name: str, patterns: list[str]) -> bool:
    """Whether checkpoint tensor `name` is matched by one of `patterns` (full match)."""
    return any(re.fullmatch(p, name) for p in patterns)

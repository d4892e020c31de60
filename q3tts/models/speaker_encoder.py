"""ECAPA-TDNN speaker encoder of the Base checkpoints: log-mel frames -> one x-vector per utterance.

Module and parameter names follow the checkpoint's `speaker_encoder.*` tensors (prefix removed). Every conv is
"same"-padded with reflection, as in the official model; reflection needs more frames than the widest pad,
which `min_num_samples` turns into a minimum reference length.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from ..config import SpeakerEncoderConfig
from ..errors import AudioError
from .mel import MEL_HOP, MEL_PAD, mel_spectrogram


def _same_conv(in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1) -> nn.Conv1d:
    # "same" output length with reflected edges (official); a 1-wide kernel pads nothing, so it skips the pad op.
    mode = "reflect" if kernel_size > 1 else "zeros"
    return nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, padding="same", padding_mode=mode)


class TimeDelayNetBlock(nn.Module):
    """Conv1d + ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = _same_conv(in_channels, out_channels, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Splits channels into `scale` groups; group i > 0 is convolved after adding the previous group's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outputs = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            outputs.append(block(parts[i] if i == 1 else parts[i] + outputs[-1]))
        return torch.cat(outputs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """Channel gates from the time-averaged input: x * sigmoid(conv2(relu(conv1(mean_t x))))."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _same_conv(channels, se_channels, 1)
        self.conv2 = _same_conv(se_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.sigmoid(self.conv2(torch.relu(self.conv1(x.mean(dim=2, keepdim=True)))))  # [B, C, 1]
        return x * gates


class SqueezeExcitationRes2NetBlock(nn.Module):
    """TDNN(k1) -> Res2Net -> TDNN(k1) -> SE, plus the input (same channel count in and out)."""

    def __init__(self, in_channels: int, out_channels: int, scale: int, se_channels: int, kernel_size: int,
                 dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(in_channels, out_channels, 1, 1)
        self.res2net_block = Res2NetBlock(out_channels, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(out_channels, out_channels, 1, 1)
        self.se_block = SqueezeExcitationBlock(out_channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _statistics(x: torch.Tensor, weights: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean and std over time; x: [B, C, T], weights sum to 1 over T -> two [B, C]."""
    mean = (weights * x).sum(dim=2)
    std = torch.sqrt((weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2).clamp(eps))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    """Attention over time (conditioned on the global mean/std) -> weighted mean ‖ std: [B, C, T] -> [B, 2C, 1]."""

    eps = 1e-12

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _same_conv(attention_channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, time = x.shape
        # Uniform weights built as the official mask / mask.sum, so 1/T rounds the same way in every dtype.
        mask = torch.ones(batch, 1, time, dtype=x.dtype, device=x.device)
        mean, std = _statistics(x, mask / mask.sum(dim=2, keepdim=True), self.eps)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attention = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)  # [B, C, T]
        mean, std = _statistics(x, attention, self.eps)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector: `forward(mels [B, T, mel_dim]) -> [B, enc_dim]`."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList([TimeDelayNetBlock(config.mel_dim, channels[0], kernels[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(SqueezeExcitationRes2NetBlock(
                channels[i - 1], channels[i], config.enc_res2net_scale, config.enc_se_channels, kernels[i],
                dilations[i]))
        # Multi-layer feature aggregation over the SE-Res2Net outputs; its input width must equal its output
        # width (official quirk: it is declared enc_channels[-1] -> enc_channels[-1]).
        self.mfa = TimeDelayNetBlock(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentiveStatisticsPooling(channels[-1], config.enc_attention_channels)
        self.fc = _same_conv(channels[-1] * 2, config.enc_dim, 1)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = mels.transpose(1, 2)  # [B, mel_dim, T]
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        x = self.mfa(torch.cat(outputs[1:], dim=1))  # [B, enc_channels[-1], T]
        return self.fc(self.asp(x)).squeeze(-1)


def min_num_samples(config: SpeakerEncoderConfig) -> int:
    """Shortest 24 kHz reference the encoder accepts: every reflect pad must be shorter than the mel frames
    it pads (the widest is ceil(dilation * (kernel - 1) / 2)), and the mel front end needs > 384 samples."""
    widest_pad = max(math.ceil(d * (k - 1) / 2) for k, d in zip(config.enc_kernel_sizes, config.enc_dilations))
    return max((widest_pad + 1) * MEL_HOP, MEL_PAD + 1)


@torch.inference_mode()
def compute_speaker_embedding(encoder: SpeakerEncoder, wav_24k: np.ndarray) -> torch.Tensor:
    """x-vector `[enc_dim]` of one mono 24 kHz waveform, as the official `extract_speaker_embedding`: the mel in
    fp32 on the CPU, then the encoder in its own dtype and device."""
    wav = np.asarray(wav_24k, dtype=np.float32)
    if wav.ndim != 1:
        raise AudioError(f"speaker embedding needs a mono waveform [samples], got shape {wav.shape}")
    needed = min_num_samples(encoder.config)
    if wav.shape[0] < needed:
        raise AudioError(f"reference audio too short: {wav.shape[0]} samples ({wav.shape[0] / 24:.0f} ms) at "
                         f"24 kHz; the speaker encoder needs at least {needed} ({needed / 24:.0f} ms)")
    mels = mel_spectrogram(torch.from_numpy(wav).unsqueeze(0))  # [1, T, mel_dim]
    param = next(encoder.parameters())
    return encoder(mels.to(device=param.device, dtype=param.dtype))[0]

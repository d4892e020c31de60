"""The speaker encoder's front end: log-mel features of 24 kHz audio, as the official `mel_spectrogram`.

Reproduced without librosa: `mel_filterbank` is `librosa.filters.mel` (Slaney scale and norm). In models/, beside
the encoder it feeds (loading reference audio, which may fetch URLs, is the request's: `q3tts.request.audio`)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..errors import AudioError

# Speaker-encoder mel front end (official `extract_speaker_embedding` arguments).
MEL_SAMPLE_RATE = 24000
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_WIN = 1024
MEL_N_MELS = 128
MEL_FMIN = 0.0
MEL_FMAX = 12000.0
MEL_PAD = (MEL_N_FFT - MEL_HOP) // 2  # 384 reflect-padded samples on each side


@functools.lru_cache(maxsize=8)
def mel_filterbank(sr: float = MEL_SAMPLE_RATE, n_fft: int = MEL_N_FFT, n_mels: int = MEL_N_MELS,
                   fmin: float = MEL_FMIN, fmax: float = MEL_FMAX) -> np.ndarray:
    """`librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)`: float32 `[n_mels, 1 +
    n_fft // 2]`, Slaney mel scale and Slaney area norm, with librosa's float64 math and float32 storage."""
    fft_freqs = np.fft.rfftfreq(n=n_fft, d=1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fft_freqs)
    weights = np.zeros((n_mels, 1 + n_fft // 2), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    weights *= enorm[:, np.newaxis]  # float64 product stored in float32, as librosa's in-place multiply
    weights.flags.writeable = False  # shared through the cache
    return weights


_MIN_LOG_HZ = 1000.0
_F_SP = 200.0 / 3
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0


def _hz_to_mel(hz: float) -> float:
    # Slaney scale: linear below 1 kHz, logarithmic above.
    return _MIN_LOG_MEL + np.log(hz / _MIN_LOG_HZ) / _LOGSTEP if hz >= _MIN_LOG_HZ else hz / _F_SP


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freqs = _F_SP * mels
    log_t = mels >= _MIN_LOG_MEL
    freqs[log_t] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mels[log_t] - _MIN_LOG_MEL))
    return freqs


@functools.lru_cache(maxsize=8)
def _mel_basis(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(mel_filterbank().copy()).float().to(device)


@functools.lru_cache(maxsize=8)
def _hann_window(device: torch.device) -> torch.Tensor:
    return torch.hann_window(MEL_WIN).to(device)


def mel_spectrogram(wav: torch.Tensor) -> torch.Tensor:
    """Log-mel features of 24 kHz audio, as the official speaker-encoder front end: `[B, N] -> [B, N // 256, 128]`.

    Reflect-pad 384 samples each side, STFT (n_fft 1024, hop 256, periodic Hann, no centring), magnitude
    `sqrt(re² + im² + 1e-9)`, Slaney mel matmul, `log(clamp(x, 1e-5))`. Computed in fp32 on `wav`'s device
    (official: fp32 on CPU). Unlike the official function this prints no warning for samples beyond ±1.
    """
    if wav.ndim != 2:
        raise AudioError(f"mel_spectrogram expects [batch, samples], got shape {tuple(wav.shape)}")
    if wav.shape[-1] <= MEL_PAD:
        raise AudioError(f"audio too short for the speaker encoder: {wav.shape[-1]} samples, it needs more "
                         f"than {MEL_PAD} ({MEL_PAD / MEL_SAMPLE_RATE * 1000:.0f} ms at 24 kHz)")
    wav = wav.float()
    y = torch.nn.functional.pad(wav.unsqueeze(1), (MEL_PAD, MEL_PAD), mode="reflect").squeeze(1)
    spec = torch.stft(y, MEL_N_FFT, hop_length=MEL_HOP, win_length=MEL_WIN, window=_hann_window(wav.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, 513, T]
    mel = torch.matmul(_mel_basis(wav.device), spec)  # [B, 128, T]; this operand order keeps official rounding
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)

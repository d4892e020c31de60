"""Speaker embeddings given as numbers rather than computed from a recording: what users bring from elsewhere.

Three shapes come in: a tensor or sequence (Python; the official `ref_spk_embedding`), a list of floats or base64
of little-endian float32 (vLLM-Omni's `speaker_embedding` request field), and a file (faster-qwen3-tts's
`extract_speaker.py` writes a `torch.save`d tensor, bf16 for 1.7B; or raw float32). Each becomes one float32 CPU
vector [hidden], with its values checked, so that a voice made from it is refused here and never mid-batch.
"""

from __future__ import annotations

import base64
import binascii
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RequestError, RequestTypeError


def embedding_tensor(value: Any, param: str = "embedding") -> torch.Tensor:
    """`value` (a float tensor or array of shape [H] or [1, H], or a sequence of numbers) as a float32 CPU [H]
    tensor; RequestError naming `param` if it is not one or holds NaN or infinite values."""
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value, dtype=np.float64)  # ([[...]]: one row, as a tensor [1, H])
        except (TypeError, ValueError):
            raise RequestTypeError(f"{param} must be numbers (a speaker embedding)", param) from None
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value) if value.dtype.kind in "fiu" else None
    if not isinstance(value, torch.Tensor):
        raise RequestTypeError(f"{param} must be a float tensor, array or list of numbers, got "
                               f"{type(value).__name__}", param)
    if not value.is_floating_point() or value.dim() not in (1, 2) or (value.dim() == 2 and value.shape[0] != 1):
        raise RequestError(f"{param} must be a float vector [hidden] (or [1, hidden]), got a {value.dtype} tensor "
                           f"of shape {list(value.shape)}", param)
    if value.numel() == 0:
        raise RequestError(f"{param} is empty", param)
    vector = value.detach().reshape(-1).to("cpu", torch.float32)
    if not bool(torch.isfinite(vector).all()):  # (float64 values beyond float32's range included)
        raise RequestError(f"{param} holds NaN or infinite values", param)
    return vector.contiguous()


def decode_base64(text: str, param: str = "speaker_embedding") -> list[float]:
    """Base64 of little-endian float32 values (vLLM-Omni's packed form) as a list of floats."""
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{param}: a string must be base64 of little-endian float32 values ({e})", param) from e
    if not data or len(data) % 4:
        raise RequestError(f"{param}: base64 of {len(data)} bytes is not whole float32 values (4 bytes each)", param)
    return np.frombuffer(data, dtype="<f4").astype(np.float64).tolist()


def read_embedding(path: str | Path) -> torch.Tensor:
    """A speaker embedding file: a `torch.save`d tensor (loaded with weights_only=True: no code runs; any float
    dtype) or raw little-endian float32. RequestError (param "embedding") naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise RequestError(f"{path}: embedding file not found", "embedding", code="not_found")
    if zipfile.is_zipfile(path):  # (torch.save's format)
        try:
            value = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # (pickle and zip errors of every kind)
            raise RequestError(f"{path}: not a readable torch.save file ({e})", "embedding") from e
        if not isinstance(value, torch.Tensor):
            raise RequestError(f"{path}: holds a {type(value).__name__}; a speaker embedding file holds one tensor",
                               "embedding")
    else:
        data = path.read_bytes()
        if not data or len(data) % 4:
            raise RequestError(f"{path}: neither a torch.save file nor raw float32 ({len(data)} bytes is not a "
                               "multiple of 4)", "embedding")
        value = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())
    try:
        return embedding_tensor(value)
    except RequestError as e:
        raise RequestError(f"{path}: {e.message}", "embedding") from e

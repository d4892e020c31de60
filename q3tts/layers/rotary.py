"""Rotary position embeddings, rotate-half (NeoX) layout.

The talker's M-RoPE has three identical position rows, which reduces exactly to this 1-D form.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """`1 / theta^(2i/d)`, computed as transformers' default RoPE init does (int64 arange, then float)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [..., T] integer -> cos, sin: [..., T, head_dim] in fp32."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, T, D] (fp32, cast to x's dtype as the official code does)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin

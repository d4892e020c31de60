from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: variance in fp32, then `weight * x.to(input_dtype)` (the official order of operations)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

"""Random weights for tiny test checkpoints.

Every tensor is drawn fresh: stock initialisations leave codebooks at zero and norms, Snake parameters and
layer scales constant, which hides bugs (a wrong norm weight or a swapped codebook would go unnoticed).
"""

from __future__ import annotations

import math

import torch


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A plausible random value for checkpoint tensor `name`, chosen by what the name says it is (fp32, on the
    generator's device)."""
    leaf = name.rsplit(".", 1)[-1]
    device = generator.device

    def randn(scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale + offset

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device) * (hi - lo) + lo

    if leaf == "initialized":
        return torch.ones(shape, device=device)
    if leaf == "cluster_usage":
        return uniform(0.5, 2.0)
    if leaf in ("embed_sum", "embedding_sum"):
        return randn()
    if leaf == "bias":
        return randn(0.05)
    if leaf == "scale":  # LayerScale
        return uniform(0.05, 0.2)
    if leaf in ("alpha", "beta"):  # SnakeBeta, log scale
        return randn(0.2)
    if leaf == "gamma":  # ConvNeXt layer scale
        return uniform(0.05, 0.2)
    if len(shape) == 1:  # norm weights
        return randn(0.1, 1.0)
    if "embedding" in name:
        return randn(0.5)
    fan_in = math.prod(shape[1:])
    return randn(fan_in**-0.5)


def random_state_dict(shapes: dict[str, tuple[int, ...]], seed: int, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One fresh random tensor per name, reproducible from `seed` (per device) and independent of dict order."""
    out = {}
    for name in sorted(shapes):
        generator = torch.Generator(device).manual_seed(seed * 1_000_003 + _stable_hash(name))
        out[name] = random_tensor(name, tuple(shapes[name]), generator).to(dtype).contiguous()
    return out


def _stable_hash(text: str) -> int:
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 2_147_483_647
    return h

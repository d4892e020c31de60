"""The norm and activation kernels, and the frame embedding's sum, against their PyTorch twins
(tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import activation, norm  # noqa: E402
from tests.kernels.twins import DEVICE, DTYPES, close, twin  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(monkeypatch, dtype, with_residual):
    g = torch.Generator(DEVICE).manual_seed(1)
    x = torch.randn(5, 96, device=DEVICE, generator=g).to(dtype)
    res = torch.randn(5, 96, device=DEVICE, generator=g) if with_residual else None
    w = (1 + 0.1 * torch.randn(96, device=DEVICE, generator=g)).to(dtype)
    y, r = norm.add_rmsnorm(x, res, w, 1e-6, dtype)
    y_ref, r_ref = twin(monkeypatch, norm.add_rmsnorm, x, res, w, 1e-6, dtype)
    close(y, y_ref, dtype)
    assert torch.equal(r, r_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(monkeypatch, dtype):
    x = torch.randn(3, 2 * 1500, device=DEVICE).to(dtype)
    close(activation.silu_mul(x), twin(monkeypatch, activation.silu_mul, x), dtype)


def test_frame_sum_adds_in_order():
    """The frame embedding's fp32 sum (3 kernels on CUDA) equals adding the 16 embeddings one by one, bit for
    bit; magnitudes spread so that another order would round differently."""
    from q3tts.engine.runner.frame import frame_sum

    g = torch.Generator(DEVICE).manual_seed(3)
    dtype = DTYPES[-1]
    embeds = [(torch.randn(4, 256, device=DEVICE, generator=g) * 10.0 ** (i % 5 - 2)).to(dtype) for i in range(16)]
    expected = embeds[0].float()
    for e in embeds[1:]:
        expected = expected + e.float()
    assert torch.equal(frame_sum(torch.stack(embeds)), expected)
    backwards = embeds[-1].float()
    for e in embeds[-2::-1]:
        backwards = backwards + e.float()
    assert not torch.equal(backwards, expected)  # the order shows in the bits

"""The interpreter's `tl.reduce` with a combine function, as tests/kernels/conftest.py runs it (`tree_reduce`: whole
halves combined at once), against numpy: along either axis, kept dimensions or not, lengths that are no power of
two, several values at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from tests.kernels.twins import DEVICE  # noqa: E402


@triton.jit
def _sum_max_min(a_sum, a_max, a_min, b_sum, b_max, b_min):
    return a_sum + b_sum, tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)


@triton.jit
def _reduce_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, N: tl.constexpr, AXIS: tl.constexpr,
                   KEEP: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
    total, big, small = tl.reduce((x, x, x), AXIS, _sum_max_min, keep_dims=KEEP)
    if KEEP:
        total, big, small = tl.reshape(total, [N]), tl.reshape(big, [N]), tl.reshape(small, [N])
    cols = tl.arange(0, N)
    tl.store(out_ptr + cols, total)
    tl.store(out_ptr + N + cols, big)
    tl.store(out_ptr + 2 * N + cols, small)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape", [(8, 4), (4, 32), (1, 16)])
def test_reduce_with_a_combine_function(shape, axis, keep):
    R, C = shape
    x = torch.randn(R, C, generator=torch.Generator().manual_seed(R * C + axis))
    n = C if axis == 0 else R
    out = torch.zeros(3, n, device=DEVICE)
    _reduce_kernel[(1,)](x.to(DEVICE), out, R, C, n, axis, keep)
    total, big, small = out.cpu().numpy()
    ref = x.numpy()
    assert np.array_equal(big, ref.max(axis)) and np.array_equal(small, ref.min(axis))
    assert np.allclose(total, ref.sum(axis), rtol=1e-6, atol=1e-6)

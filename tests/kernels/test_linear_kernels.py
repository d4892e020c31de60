"""The fused products (the tensor-core kernel, split over K, the matrix-vector kernel) with their fused neighbours
against the unfused PyTorch twin, at every measured tile (tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import linear  # noqa: E402
from tests.kernels.twins import DEVICE, DTYPES, close, twin  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("kind", ["plain", "norm", "norm_in_dtype", "swiglu", "residual", "residual_in_dtype",
                                  "logits"])
def test_fused_linear(monkeypatch, dtype, M, kind):
    """The small-batch product with its fused neighbours against the unfused twin; K not a multiple of the
    K tile, N not a multiple of the N tile, so every mask is exercised."""
    g = torch.Generator(DEVICE).manual_seed(M)
    K, N = (200, 2 * 40) if kind == "swiglu" else (1024 if M == 16 else 200, 72)
    w = (0.1 * torch.randn(N, K, device=DEVICE, generator=g)).to(dtype)
    x = torch.randn(M, K, device=DEVICE, generator=g)
    kwargs = {}
    if kind in ("norm", "norm_in_dtype", "swiglu"):
        kwargs = dict(norm=(1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype), eps=1e-6)
    if kind not in ("norm", "swiglu"):  # (the stream in fp32, or a first layer's input in the weights' dtype)
        x = x.to(dtype)
    if kind == "swiglu":
        kwargs["swiglu"] = True
    if kind.startswith("residual"):  # the stream in fp32, or a first layer's input in the weights' dtype
        kwargs["residual"] = torch.randn(M, N, device=DEVICE, generator=g)
        if kind == "residual_in_dtype":
            kwargs["residual"] = kwargs["residual"].to(dtype)
    if kind == "logits":
        kwargs["fp32_out"] = True
    out = linear.fused_linear(x, w, **kwargs)
    ref = twin(monkeypatch, linear.fused_linear, x, w, **kwargs)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (M, N // 2 if kind == "swiglu" else N)
    if kind == "logits":  # not rounded to the weights' dtype: as close as fp32 sums in another order
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    close(out, ref, dtype)


@pytest.mark.parametrize("M", [5, 40])
def test_fused_linear_hands_on_sums_of_squares(monkeypatch, M):
    """Beyond the matrix-vector kernel's rows: a residual add's partial sums of squares (squares_out) add up to its
    output rows' sums of squares, and a norm that takes them (squares), or row_squares' of its input, or every
    other row's of either, or none (the kernel reads its rows), equals the unfused twin; 40 rows span several row
    blocks (FUSED_BLOCK_M 16 here)."""
    monkeypatch.setattr(linear, "FUSED_BLOCK_M", 16)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(M)
    K, N = 200, 72
    x = torch.randn(M, K, device=DEVICE, generator=g).to(dtype)
    w_o = (0.1 * torch.randn(N, K, device=DEVICE, generator=g)).to(dtype)
    stream = torch.randn(M, N, device=DEVICE, generator=g) * torch.linspace(0.1, 10, M, device=DEVICE)[:, None]
    residual, squares = linear.fused_linear(x, w_o, residual=stream, squares_out=True)
    assert squares.shape == (-(-N // linear.fused_linear_tiles(16, N, K, False)[0]), M)
    torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)
    close(residual, twin(monkeypatch, linear.fused_linear, x, w_o, residual=stream), dtype)
    w = (0.1 * torch.randn(2 * 40, N, device=DEVICE, generator=g)).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
    first = torch.randn(M, N, device=DEVICE, generator=g)
    for inputs, sums in ((residual, squares), (first, linear.row_squares(first)), (first, None),
                         (residual[1::2], squares[:, 1::2]), (first[1::2], linear.row_squares(first)[:, 1::2])):
        for kwargs in (dict(norm=norm_w, eps=1e-6, swiglu=True), dict(norm=norm_w, eps=1e-6, fp32_out=True)):
            out = linear.fused_linear(inputs, w, squares=sums, **kwargs)
            close(out, twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)
    with pytest.raises(ValueError, match="squares_out"):
        linear.fused_linear(x, w_o, squares_out=True)
    with pytest.raises(ValueError, match="squares"):
        linear.fused_linear(x, w_o, squares=squares)


@pytest.mark.parametrize("tiles", sorted(set(linear.FUSED_LINEAR_TILES.values())))
def test_fused_linear_with_each_measured_tile(monkeypatch, tiles):
    """Every tile shape of the measured table computes the same product (K a multiple of the K tile, as in the
    real layers; N not a multiple of the N tile), SwiGLU and residual forms alike."""
    monkeypatch.setattr(linear, "fused_linear_tiles", lambda *args: tiles)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(7)
    K = 2 * tiles[1]
    w = (0.1 * torch.randn(2 * 40, K, device=DEVICE, generator=g)).to(dtype)
    x = torch.randn(3, K, device=DEVICE, generator=g)
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
    for kwargs, inputs in ((dict(norm=norm, eps=1e-6, swiglu=True), x),
                           (dict(residual=torch.randn(3, 80, device=DEVICE, generator=g)), x.to(dtype))):
        out = linear.fused_linear(inputs, w, **kwargs)
        close(out, twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)


@pytest.mark.parametrize("split", [2, 3, 4])
def test_fused_linear_split_over_k(monkeypatch, split):
    """The K columns split among several programs per column block (the last to finish adds the ranges' sums,
    in order): the same products as the twin, every fused neighbour, K not a multiple of the ranges (the last one
    short), several row and column blocks; the partial sums of squares handed on add up; the counters are back at
    zero after each call, so the next call (and a captured graph's next replay) starts clean."""
    monkeypatch.setattr(linear, "FUSED_BLOCK_M", 16)
    monkeypatch.setattr(linear, "fused_linear_tiles", lambda *args: (16, 32, 4, 2, split))
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(split)
    M, K, N = 20, 200, 40
    x = torch.randn(M, K, device=DEVICE, generator=g) * torch.linspace(0.1, 10, M, device=DEVICE)[:, None]
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
    w = (0.1 * torch.randn(2 * N, K, device=DEVICE, generator=g)).to(dtype)
    stream = torch.randn(M, 2 * N, device=DEVICE, generator=g)
    for kwargs, inputs in ((dict(norm=norm, eps=1e-6, swiglu=True, squares=linear.row_squares(x)), x),
                           (dict(norm=norm, eps=1e-6), x), (dict(norm=norm, eps=1e-6, fp32_out=True), x),
                           (dict(residual=stream), x.to(dtype)), ({}, x.to(dtype))):
        out = linear.fused_linear(inputs, w, **kwargs)
        kwargs.pop("squares", None)
        close(out, twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)
        assert not linear.split_arrivals(out.device, 1).any()
    residual, squares = linear.fused_linear(x.to(dtype), w, residual=stream, squares_out=True)
    torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)


GEMV_TILE_LIST = [(1, 64, 4, 3), (2, 128, 2, 2), (8, 256, 8, 4)] + sorted(
    set(linear.GEMV_TILES.values()) | set(linear.GEMV_TWO_ROW_TILES.values()))


@pytest.mark.parametrize("tiles", GEMV_TILE_LIST)
def test_gemv_with_each_tile(monkeypatch, tiles):
    """The matrix-vector kernel computes the same product with every tile shape, for one row and two: the
    measured ones and a few small ones the interpreter can run (K a multiple of the K tile or not, N not a
    multiple of the N tile), every fused neighbour, the norm of each row its own. Each tile runs every shape and
    every fused neighbour, not all their pairs (the interpreter's time): the pairs rotate with the tile, so that
    the tiles together run them all."""
    monkeypatch.setattr(linear, "_gemv_tiles", lambda *args: tiles)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(11)
    shapes = [(M, K) for M in range(1, linear.GEMV_MAX_ROWS + 1) for K in (2 * tiles[1], tiles[1] + 40)]
    neighbours = ("swiglu", "norm", "residual", "plain", "fp32_out", "norm_fp32_out")
    turn = GEMV_TILE_LIST.index(tiles)
    for i, name in enumerate(neighbours):
        M, K = shapes[(i + turn) % len(shapes)]
        w = (0.1 * torch.randn(2 * 37, K, device=DEVICE, generator=g)).to(dtype)
        x = torch.randn(M, K, device=DEVICE, generator=g) * torch.tensor([1.0, 30.0][:M], device=DEVICE)[:, None]
        norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
        kwargs, inputs = {"swiglu": (dict(norm=norm, eps=1e-6, swiglu=True), x), "norm": (dict(norm=norm, eps=1e-6), x),
                          "residual": (dict(residual=torch.randn(M, 74, device=DEVICE, generator=g)), x.to(dtype)),
                          "plain": ({}, x.to(dtype)), "fp32_out": (dict(fp32_out=True), x.to(dtype)),
                          "norm_fp32_out": (dict(norm=norm, eps=1e-6, fp32_out=True), x)}[name]
        out = linear.fused_linear(inputs, w, **kwargs)
        close(out, twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)

"""The codec decoder's kernels (causal convolutions, residual units, transposed convolutions, the ring attention
step) against their PyTorch twins (tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import codec as codec_kernels  # noqa: E402
from tests.kernels.twins import DEVICE, DTYPES, close, twin  # noqa: E402


def _snake(C, g):
    return codec_kernels.snake_params(0.2 * torch.randn(C, device=DEVICE, generator=g),
                                      torch.randn(C, device=DEVICE, generator=g))


def _check_act(act, ref_act, context, dtype):
    """act = [the consumer's kept context, SnakeBeta(y)]: the context copied exactly, the rest close."""
    L = 0 if context is None else context.shape[1]
    assert act.shape == ref_act.shape
    if L:
        assert torch.equal(act[:, :L], context) and torch.equal(ref_act[:, :L], context)
    close(act[:, L:], ref_act[:, L:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,dilation,T,residual,snake,keep_out,context", [
    (7, 9, 5, False, True, False, 0),     # fewer new steps than the kept context
    (7, 3, 40, False, False, True, 0),    # more
    (1, 1, 33, True, True, True, 18),     # the residual unit's second conv: no state, residual, both outputs,
                                          # its activation written behind the next convolution's context
    (3, 1, 2, False, True, True, 6),
])
def test_causal_conv(monkeypatch, dtype, k, dilation, T, residual, snake, keep_out, context):
    g = torch.Generator(DEVICE).manual_seed(3)
    B, C_in, C_out, L = 3, 40, 24, (k - 1) * dilation
    x = torch.randn(B, T, C_in, device=DEVICE, generator=g).to(dtype)
    w = (0.2 * torch.randn(k, C_in, C_out, device=DEVICE, generator=g)).to(dtype)
    bias = torch.randn(C_out, device=DEVICE, generator=g).to(dtype)
    state = torch.randn(B, L, C_in, device=DEVICE, generator=g).to(dtype) if L else None
    res = torch.randn(B, T, C_out, device=DEVICE, generator=g).to(dtype) if residual else None
    params = _snake(C_out, g) if snake else None
    ctx = torch.randn(B, context, C_out, device=DEVICE, generator=g).to(dtype) if context else None
    kwargs = dict(residual=res, snake=params, keep_out=keep_out, act_context=ctx)
    xp = x if state is None else torch.cat([state, x], dim=1)  # the kept context in front of the new steps
    ref_state = None if state is None else state.clone()
    out, act = codec_kernels.causal_conv(xp, state, w, bias, dilation, **kwargs)
    ref_out, ref_act = twin(monkeypatch, codec_kernels.causal_conv, xp, ref_state, w, bias, dilation, **kwargs)
    assert (out is None) == (ref_out is None) == (not keep_out)
    if keep_out:
        close(out, ref_out, dtype)
    assert (act is None) == (ref_act is None) == (not snake)
    if snake:
        _check_act(act, ref_act, ctx, dtype)
    if state is not None:  # the last L steps of [state, x]
        assert torch.equal(state, ref_state)
        assert torch.equal(state[:, -min(T, L):], x[:, -min(T, L):])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C,dilation,T,keep_out,context", [
    (24, 9, 5, True, 18),    # fewer new steps than the kept context; C not a power of two
    (40, 3, 37, False, 0),   # more; rows not a multiple of the tile; the last unit (no y kept)
    (96, 1, 70, True, 54),   # the codec's last stage: several pointwise column tiles
    (4, 1, 9, True, 6),      # fewer channels than the smallest matrix-product tile (the tiny codec's)
])
def test_residual_unit(monkeypatch, dtype, C, dilation, T, keep_out, context):
    g = torch.Generator(DEVICE).manual_seed(5)
    B, L = 3, 6 * dilation
    x = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype)
    w1 = (torch.randn(7, C, C, device=DEVICE, generator=g) / (7 * C) ** 0.5).to(dtype)
    w2 = (torch.randn(1, C, C, device=DEVICE, generator=g) / C ** 0.5).to(dtype)
    b1, b2 = (torch.randn(C, device=DEVICE, generator=g).to(dtype) for _ in range(2))
    state = torch.randn(B, L, C, device=DEVICE, generator=g).to(dtype)
    res = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype)
    mid, after = _snake(C, g), _snake(C, g)
    ctx = torch.randn(B, context, C, device=DEVICE, generator=g).to(dtype) if context else None
    assert codec_kernels.unit_config(B * T, C) is not None  # the fused kernel runs, not the two-call fallback
    xp, ref_state = torch.cat([state, x], dim=1), state.clone()
    out, act = codec_kernels.residual_unit(xp, state, w1, b1, mid, w2, b2, res, after, dilation, keep_out, ctx)
    ref_out, ref_act = twin(monkeypatch, codec_kernels.residual_unit, xp, ref_state, w1, b1, mid, w2, b2, res, after,
                             dilation, keep_out, ctx)
    assert (out is None) == (ref_out is None) == (not keep_out)
    if keep_out:
        close(out, ref_out, dtype)
    _check_act(act, ref_act, ctx, dtype)
    assert torch.equal(state, ref_state) and torch.equal(state, xp[:, -L:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", [0, 6])
def test_conv_transpose(monkeypatch, dtype, context):
    g = torch.Generator(DEVICE).manual_seed(4)
    B, T, C_in, C_out, s = 2, 5, 32, 20, 3
    x = torch.randn(B, T, C_in, device=DEVICE, generator=g).to(dtype)
    w = (0.2 * torch.randn(C_in, 2 * s * C_out, device=DEVICE, generator=g)).to(dtype)
    bias = torch.randn(C_out, device=DEVICE, generator=g).to(dtype)
    tail = torch.randn(B, s, C_out, device=DEVICE, generator=g).to(dtype)
    params, ref_tail = _snake(C_out, g), tail.clone()
    ctx = torch.randn(B, context, C_out, device=DEVICE, generator=g).to(dtype) if context else None
    out, act = codec_kernels.conv_transpose(x, tail, w, bias, s, params, ctx)
    ref_out, ref_act = twin(monkeypatch, codec_kernels.conv_transpose, x, ref_tail, w, bias, s, params, ctx)
    close(out, ref_out, dtype)
    _check_act(act, ref_act, ctx, dtype)
    assert torch.equal(tail, ref_tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (4, 2)])
def test_ring_attention_step(monkeypatch, dtype, num_heads, num_kv):
    g = torch.Generator(DEVICE).manual_seed(6)
    B, W, D = 4, 7, 16
    positions = torch.tensor([0, 3, 6, 40], device=DEVICE)  # a fresh stream, part-filled, just full, wrapped
    qkv = torch.randn(B, (num_heads + 2 * num_kv) * D, device=DEVICE, generator=g).to(dtype)
    k_ring = torch.randn(B, num_kv, W, D, device=DEVICE, generator=g).to(dtype)
    v_ring = torch.randn(B, num_kv, W, D, device=DEVICE, generator=g).to(dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    rings = (k_ring.clone(), v_ring.clone())
    out = codec_kernels.ring_attention_step(qkv, positions, k_ring, v_ring, inv_freq, num_heads, None)
    ref = twin(monkeypatch, codec_kernels.ring_attention_step, qkv, positions, *rings, inv_freq, num_heads, None)
    close(out, ref, dtype)
    for ring, ref_ring in zip((k_ring, v_ring), rings):
        close(ring, ref_ring, dtype)
    # only each row's slot (position % W) was written
    slot = positions % W
    for b in range(B):
        others = torch.arange(W, device=DEVICE) != slot[b]
        assert torch.equal(k_ring[b][:, others], rings[0][b][:, others])


def test_wide_tiles_take_over_from_their_row_count():
    """The real codec's 768- and 384-channel convolutions change tiles at 128 streams' rows (WIDE_CONV_CONFIGS),
    not below (where the narrower ones are as fast or faster)."""
    for (k, c_in, c_out), (rows, tile) in codec_kernels.WIDE_CONV_CONFIGS.items():
        assert codec_kernels.conv_config(rows, k, c_in, c_out) == tile
        assert codec_kernels.conv_config(rows - 1, k, c_in, c_out) == codec_kernels.CONV_CONFIGS[(k, c_in, c_out)]

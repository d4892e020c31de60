"""Kernels of the streaming codec decoder, each with a plain-PyTorch twin of the same semantics (the CPU path,
and what the tests compare the kernels against): the vocoder's, time-major ([B, T, C]: channels last), and the
pre-transformer's one-frame attention step over its ring of kept keys and values (`ring_attention_step`).

The vocoder is causal convolutions (kernel 7, dilations 1/3/9, and kernel 1), transposed convolutions with
overlap, and SnakeBeta activations. Channel-major convolutions through cuDNN ran at a fraction of the tensor
cores' rate and needed a concatenation per convolution to put the stream's kept context before the new samples.
Here one kernel is one implicit matrix product: output row (b, t) = bias + sum over taps j of
input(b, t + j * dilation) @ W[j], over an input that holds each stream's kept context (L = (k - 1) * dilation
steps) in front of its T new steps, [B, L + T, C_in]; rows of all streams are one M dimension, so a call of one
frame per stream still fills the tiles. The kernel that produces a convolution's input writes it there directly:
every producer takes `act_context`, the consuming convolution's kept context, and returns its activation as
[B, L + T, C] with that context in front (a copy of L steps, not a concatenation of T). Bias, residual add and
the next SnakeBeta run in the epilogue; a residual unit for C <= 256 is one kernel (`residual_unit`).

SnakeBeta(x) = x + inv_beta * sin(alpha * x)^2 with alpha = exp(log_alpha), inv_beta = 1 / (exp(log_beta) + 1e-9)
(`snake_params` computes the two per-channel vectors once).
"""

from __future__ import annotations

import torch

from ..layers.rotary import rope_cos_sin, rotate_half
from .backend import triton, use_triton

if triton is not None:
    import triton.language as tl


def snake_params(log_alpha: torch.Tensor, log_beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (alpha, inv_beta) in fp32 from SnakeBeta's stored log-scale parameters."""
    return torch.exp(log_alpha.float()), 1.0 / (torch.exp(log_beta.float()) + 1e-9)


def _snake_ref(y: torch.Tensor, snake: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    alpha, inv_beta = snake
    return y + inv_beta * torch.sin(y * alpha) ** 2


def _fast_sin(x: torch.Tensor) -> bool:
    # Half-precision outputs cannot tell the hardware's approximate sine from libdevice's (2^-21 abs. error).
    return x.is_cuda and x.dtype != torch.float32


def _act_buffer(like: torch.Tensor, B: int, T: int, C: int, act_context: torch.Tensor | None) -> torch.Tensor:
    """[B, L + T, C] with the consuming convolution's kept context (L steps) in front, the rest to be written."""
    L = 0 if act_context is None else act_context.shape[1]
    buf = torch.empty(B, L + T, C, dtype=like.dtype, device=like.device)
    if L:
        buf[:, :L] = act_context
    return buf


def _with_context(act: torch.Tensor, act_context: torch.Tensor | None) -> torch.Tensor:
    return act if act_context is None else torch.cat([act_context, act], dim=1)


def _keep_last(state: torch.Tensor | None, x: torch.Tensor) -> None:
    """state <- the last L steps of x = [kept context, new steps] (runs after the convolution has read x)."""
    if state is not None and state.shape[1]:
        state.copy_(x[:, x.shape[1] - state.shape[1]:])


# ---- causal convolution ------------------------------------------------------------------------------------------

def causal_conv(x: torch.Tensor, state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                dilation: int = 1, residual: torch.Tensor | None = None,
                snake: tuple[torch.Tensor, torch.Tensor] | None = None, keep_out: bool = True,
                act_context: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One streaming step of a causal convolution, time-major.

    x: [B, L + T, C_in] (contiguous), the stream's kept context (L = (k - 1) * dilation steps, as in `state`)
    followed by the T new steps; state: [B, L, C_in] (None when L = 0), set to the last L steps of x;
    weight: [k, C_in, C_out]; bias: [C_out]. y = conv + bias (+ residual [B, T, C_out]).
    Returns (y if keep_out, SnakeBeta(y) if snake is given, with act_context [B, L', C_out] in front if given).
    """
    B, LT, C_in = x.shape
    k, _, C_out = weight.shape
    L = 0 if state is None else state.shape[1]
    if L != (k - 1) * dilation or LT < L:
        raise ValueError(f"state holds {L} steps and x {LT}, the convolution needs {(k - 1) * dilation}")
    T = LT - L
    if not use_triton(x):
        full = x.float()
        y = sum(full[:, j * dilation: j * dilation + T] @ weight[j].float() for j in range(k)) + bias.float()
        if residual is not None:
            y = y + residual.float()
        out = y.to(x.dtype) if keep_out else None
        act = _with_context(_snake_ref(y, snake).to(x.dtype), act_context) if snake is not None else None
    else:
        R = B * T
        out = torch.empty(B, T, C_out, dtype=x.dtype, device=x.device) if keep_out else None
        act = _act_buffer(x, B, T, C_out, act_context) if snake is not None else None
        L_act = 0 if act_context is None else act_context.shape[1]
        BM, BN, BK, warps, stages = conv_config(R, k, C_in, C_out)
        grid = (triton.cdiv(R, BM), triton.cdiv(C_out, BN))
        _causal_conv_kernel[grid](
            x, weight, bias, x if residual is None else residual, x if out is None else out,
            x if act is None else act[:, L_act:], bias if snake is None else snake[0],
            bias if snake is None else snake[1], R, T, LT, (L_act + T) * C_out, C_in, C_out, dilation, KS=k,
            HAS_RESIDUAL=residual is not None, WRITE_OUT=keep_out, WRITE_ACT=snake is not None,
            FAST_SIN=_fast_sin(x), IEEE=x.dtype == torch.float32, EVEN_K=C_in % BK == 0,
            BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)
    _keep_last(state, x)
    return out, act


# Tile shapes (BM, BN, BK, num_warps, num_stages) of the real codec's convolutions by (k, C_in, C_out): the
# fastest of `bench/sweeps/codec_kernels.py`'s candidates at 64 streams, one frame per stream (H100); used from 256
# rows.
CONV_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {
    (7, 1024, 1536): (64, 64, 64, 4, 3),
    (7, 768, 768): (64, 64, 64, 4, 3), (1, 768, 768): (64, 64, 64, 4, 3),
    (7, 384, 384): (128, 128, 64, 4, 3), (1, 384, 384): (128, 128, 32, 4, 3),
    (7, 192, 192): (128, 64, 32, 4, 3), (1, 192, 192): (64, 128, 64, 8, 3),  # (fused in residual units)
    (7, 96, 96): (128, 128, 32, 4, 3), (1, 96, 96): (64, 32, 32, 4, 3),  # (fused in residual units)
    (7, 96, 1): (128, 32, 32, 4, 3),
}


# ... and from 128 streams (the rows of 128 one-frame steps) for these, where wider column tiles are faster (H200,
# `bench/sweeps/codec_config_ab.py`: the codec's step -2.6% at 128 streams, -3.0% at 256, +0.7-1.2% at 16-64 if
# used there; its audio and state bit for bit those of the tiles above; perf-notes 132).
WIDE_CONV_CONFIGS: dict[tuple[int, int, int], tuple[int, tuple[int, int, int, int, int]]] = {
    (7, 768, 768): (4096, (64, 128, 64, 4, 3)), (1, 768, 768): (4096, (64, 128, 64, 4, 3)),
    (1, 384, 384): (20480, (64, 128, 64, 4, 3)),
}


def conv_config(R: int, k: int, C_in: int, C_out: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for R output rows, kernel k, C_in -> C_out channels."""
    wide = WIDE_CONV_CONFIGS.get((k, C_in, C_out))
    if wide is not None and R >= wide[0]:
        return wide[1]
    if R >= 256 and (k, C_in, C_out) in CONV_CONFIGS:
        return CONV_CONFIGS[(k, C_in, C_out)]
    BN = 16 if C_out <= 16 else 32 if C_out % 64 else 64 if C_out < 128 or C_out % 128 else 128
    BK = 16 if C_in <= 16 else 32 if C_in % 64 else 64
    BM = 128 if R >= 4096 else 64 if R >= 64 else 16
    return BM, BN, BK, 8 if BM * BN >= 128 * 128 else 4, 3


if triton is not None:
    @triton.jit
    def _causal_conv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, act_ptr, alpha_ptr, inv_beta_ptr,
                            R, T, LT, ACT_BS, C_IN, C_OUT, DIL, KS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            WRITE_OUT: tl.constexpr, WRITE_ACT: tl.constexpr, FAST_SIN: tl.constexpr,
                            IEEE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok, col_ok = rows < R, cols < C_OUT
        acc = _conv_acc(x_ptr, w_ptr, rows, row_ok, cols, col_ok, T, LT, C_IN, C_OUT, DIL, KS, IEEE, EVEN_K,
                        BM, BN, BK)
        _conv_epilogue(acc, rows, row_ok, cols, col_ok, T, ACT_BS, C_OUT, bias_ptr, res_ptr, out_ptr, act_ptr,
                       alpha_ptr, inv_beta_ptr, HAS_RESIDUAL, WRITE_OUT, WRITE_ACT, FAST_SIN)

    @triton.jit
    def _conv_acc(x_ptr, w_ptr, rows, row_ok, cols, col_ok, T, LT, C_IN, C_OUT, DIL, KS: tl.constexpr,
                  IEEE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The convolution's sum over taps and input channels for output rows x cols, fp32 [BM, BN]. Output
        row b * T + t reads input rows b * LT + t + j * DIL (the kept context in front: no masks in time)."""
        base = (rows // T).to(tl.int64) * LT + rows % T
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        n_k = tl.cdiv(C_IN, BK)
        for it in range(KS * n_k):
            j = it // n_k
            kk = (it % n_k) * BK + ks
            a_ptrs = x_ptr + (base + j * DIL)[:, None] * C_IN + kk[None, :]
            w_ptrs = w_ptr + (j * C_IN + kk)[:, None] * C_OUT + cols[None, :]
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = kk < C_IN
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE)
        return acc

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _conv_epilogue(acc, rows, row_ok, cols, col_ok, T, ACT_BS, C_OUT, bias_ptr, res_ptr, out_ptr, act_ptr,
                       alpha_ptr, inv_beta_ptr, HAS_RESIDUAL: tl.constexpr, WRITE_OUT: tl.constexpr,
                       WRITE_ACT: tl.constexpr, FAST_SIN: tl.constexpr):
        """y = acc + bias (+ residual); stores y [R, C_OUT] and/or SnakeBeta(y) (stream b's rows ACT_BS apart)."""
        y = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        offs = rows.to(tl.int64)[:, None] * C_OUT + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if HAS_RESIDUAL:
            y += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if WRITE_OUT:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        if WRITE_ACT:
            act = _snake_beta(y, alpha_ptr, inv_beta_ptr, cols, col_ok, FAST_SIN)
            act_offs = ((rows // T).to(tl.int64) * ACT_BS + (rows % T) * C_OUT)[:, None] + cols[None, :]
            tl.store(act_ptr + act_offs, act.to(act_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _snake_beta(y, alpha_ptr, inv_beta_ptr, cols, col_ok, FAST_SIN: tl.constexpr):
        """SnakeBeta of an fp32 tile y [rows, cols] with the per-channel (alpha, inv_beta) of `cols`."""
        alpha = tl.load(alpha_ptr + cols, mask=col_ok, other=0.0)[None, :]
        inv_beta = tl.load(inv_beta_ptr + cols, mask=col_ok, other=0.0)[None, :]
        x = y * alpha
        if FAST_SIN:
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                          pack=1)
        else:
            s = tl.sin(x)
        return y + inv_beta * s * s


# ---- residual unit ------------------------------------------------------------------------------------------------

def residual_unit(x: torch.Tensor, state: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
                  snake_mid: tuple[torch.Tensor, torch.Tensor], w2: torch.Tensor, b2: torch.Tensor,
                  residual: torch.Tensor, snake: tuple[torch.Tensor, torch.Tensor], dilation: int,
                  keep_out: bool = True, act_context: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A vocoder residual unit after its first SnakeBeta: y = conv2(SnakeBeta_mid(conv1(x))) + residual, with
    conv1 causal (w1: [k, C, C], dilated; x and state as in `causal_conv`) and conv2 pointwise (w2: [1, C, C]).
    The same as two `causal_conv` calls (and that is what it runs on the CPU and for C > `UNIT_MAX_CHANNELS`);
    on the GPU one kernel: a program owns all C channels of its rows, so the intermediate never leaves the chip
    (it is rounded to x's dtype before the pointwise product, as the two calls round it).
    Returns (y if keep_out, SnakeBeta(y) with act_context in front if given)."""
    B, LT, C = x.shape
    k, L = w1.shape[0], state.shape[1]
    T = LT - L
    if w1.shape[1:] != (C, C) or w2.shape != (1, C, C) or residual.shape != (B, T, C):
        raise ValueError("a residual unit maps C channels to C channels")
    if L != (k - 1) * dilation or T < 0:
        raise ValueError(f"state holds {L} steps and x {LT}, the convolution needs {(k - 1) * dilation}")
    config = unit_config(B * T, C) if use_triton(x) else None
    if config is None:
        _, h = causal_conv(x, state, w1, b1, dilation, snake=snake_mid, keep_out=False)
        return causal_conv(h, None, w2, b2, residual=residual, snake=snake, keep_out=keep_out,
                           act_context=act_context)
    R = B * T
    out = torch.empty(B, T, C, dtype=x.dtype, device=x.device) if keep_out else None
    act = _act_buffer(x, B, T, C, act_context)
    L_act = 0 if act_context is None else act_context.shape[1]
    BM, BK, BN, warps, stages = config
    _residual_unit_kernel[(triton.cdiv(R, BM),)](
        x, w1, b1, snake_mid[0], snake_mid[1], w2, b2, residual, x if out is None else out, act[:, L_act:],
        snake[0], snake[1], R, T, LT, (L_act + T) * C, C, dilation, KS=k, WRITE_OUT=keep_out,
        FAST_SIN=_fast_sin(x), IEEE=x.dtype == torch.float32, EVEN_K=C % BK == 0, BM=BM,
        CP=max(16, triton.next_power_of_2(C)), BK=BK, BN=BN, num_warps=warps, num_stages=stages)
    _keep_last(state, x)
    return out, act


# Tiles (BM, BK, BN of the pointwise product, num_warps, num_stages) by channel count: the fastest of
# `bench/sweeps/codec_kernels.py --units`' candidates at 64 streams (H100), used from 16 k rows (16 streams).
UNIT_CONFIGS: dict[int, tuple[int, int, int, int, int]] = {96: (128, 32, 64, 4, 3), 192: (128, 64, 64, 8, 3)}
UNIT_MAX_CHANNELS = 256  # above, two kernels are faster (a program's tile must span every channel: at 384,
# 167 us fused vs 72 us for the two kernels at 64 streams)


def unit_config(R: int, C: int) -> tuple[int, int, int, int, int] | None:
    """(BM, BK, BN, num_warps, num_stages) of the fused residual unit for R rows of C channels; None: unfused."""
    if C > UNIT_MAX_CHANNELS:
        return None
    if R >= 16384 and C in UNIT_CONFIGS:
        return UNIT_CONFIGS[C]
    BK = 16 if C <= 16 else 32 if C % 64 else 64
    return (64 if R >= 64 else 16), BK, min(64, max(16, triton.next_power_of_2(C))), 8 if C > 128 else 4, 3


if triton is not None:
    @triton.jit
    def _residual_unit_kernel(x_ptr, w1_ptr, b1_ptr, mid_alpha_ptr, mid_inv_beta_ptr, w2_ptr, b2_ptr, res_ptr,
                              out_ptr, act_ptr, alpha_ptr, inv_beta_ptr, R, T, LT, ACT_BS, C, DIL,
                              KS: tl.constexpr, WRITE_OUT: tl.constexpr, FAST_SIN: tl.constexpr,
                              IEEE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, CP: tl.constexpr,
                              BK: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.arange(0, CP)  # every channel: the pointwise product needs them all
        row_ok, col_ok = rows < R, cols < C
        acc = _conv_acc(x_ptr, w1_ptr, rows, row_ok, cols, col_ok, T, LT, C, C, DIL, KS, IEEE, EVEN_K, BM, CP, BK)
        h = acc + tl.load(b1_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        mid = _snake_beta(h, mid_alpha_ptr, mid_inv_beta_ptr, cols, col_ok, FAST_SIN).to(x_ptr.dtype.element_ty)
        for n in tl.static_range(CP // BN):
            cols2 = n * BN + tl.arange(0, BN)
            ok2 = cols2 < C
            w = tl.load(w2_ptr + cols[:, None] * C + cols2[None, :], mask=col_ok[:, None] & ok2[None, :], other=0.0)
            acc2 = _dot(mid, w, tl.zeros((BM, BN), dtype=tl.float32), IEEE)
            _conv_epilogue(acc2, rows, row_ok, cols2, ok2, T, ACT_BS, C, b2_ptr, res_ptr, out_ptr, act_ptr,
                           alpha_ptr, inv_beta_ptr, True, WRITE_OUT, True, FAST_SIN)


# ---- transposed convolution (kernel 2 x stride) -------------------------------------------------------------------

def conv_transpose(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int,
                   snake: tuple[torch.Tensor, torch.Tensor], act_context: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One streaming step of a transposed convolution with kernel 2 x stride, time-major.

    x: [B, T, C_in]; weight: [C_in, 2 * stride * C_out] (taps major, channels minor); tail: [B, stride, C_out],
    the previous call's last step's second half (without bias), advanced in place. Each input step writes 2s
    outputs, one matrix product [B * T, C_in] @ [C_in, 2s * C_out]; the first half of step t adds to the second
    half of step t - 1. Returns (y [B, T * stride, C_out], SnakeBeta(y) with act_context in front if given).
    """
    B, T, C_in = x.shape
    s, C_out = stride, tail.shape[-1]
    steps = (x.reshape(B * T, C_in) @ weight).view(B, T, 2 * s, C_out)
    if not use_triton(x):
        previous = torch.cat([tail[:, None], steps[:, :-1, s:]], dim=1)
        y = (steps[:, :, :s].float() + previous.float() + bias.float()).reshape(B, T * s, C_out)
        out, act = y.to(x.dtype), _with_context(_snake_ref(y, snake).to(x.dtype), act_context)
    else:
        out = torch.empty(B, T * s, C_out, dtype=x.dtype, device=x.device)
        act = _act_buffer(x, B, T * s, C_out, act_context)
        L_act = 0 if act_context is None else act_context.shape[1]
        BLOCK_R, BLOCK_C = 16, triton.next_power_of_2(min(C_out, 256))
        grid = (triton.cdiv(B * T * s, BLOCK_R), triton.cdiv(C_out, BLOCK_C))
        _overlap_add_kernel[grid](steps, tail, bias, snake[0], snake[1], out, act[:, L_act:], B * T * s, T,
                                  (L_act + T * s) * C_out, C_out, S=s, FAST_SIN=_fast_sin(x), BLOCK_R=BLOCK_R,
                                  BLOCK_C=BLOCK_C, num_warps=4)
    tail.copy_(steps[:, -1, s:])
    return out, act


if triton is not None:
    @triton.jit
    def _overlap_add_kernel(steps_ptr, tail_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, out_ptr, act_ptr, N, T, ACT_BS,
                            C, S: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # output row b * T * S + t * S + i
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        r_ok, col_ok = r < N, cols < C
        step = (r // S).to(tl.int64)  # b * T + t
        i = r % S
        first = (step % T) == 0
        mask = r_ok[:, None] & col_ok[None, :]
        y = tl.load(steps_ptr + ((step * 2 * S + i) * C)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y += tl.load(steps_ptr + (((step - 1) * 2 * S + S + i) * C)[:, None] + cols[None, :],
                     mask=mask & ~first[:, None], other=0.0).to(tl.float32)
        y += tl.load(tail_ptr + (((step // T) * S + i) * C)[:, None] + cols[None, :],
                     mask=mask & first[:, None], other=0.0).to(tl.float32)
        y += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        offs = r.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        act = _snake_beta(y, alpha_ptr, inv_beta_ptr, cols, col_ok, FAST_SIN)
        act_offs = ((r // (T * S)).to(tl.int64) * ACT_BS + (r % (T * S)) * C)[:, None] + cols[None, :]
        tl.store(act_ptr + act_offs, act.to(act_ptr.dtype.element_ty), mask=mask)


# ---- the pre-transformer's attention for one new frame per row ----------------------------------------------------

def ring_attention_step(qkv: torch.Tensor, positions: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                        inv_freq: torch.Tensor, num_heads: int, scale: float | None) -> torch.Tensor:
    """qkv: [B, (H + 2 Hkv) * D], one new frame per row at `positions` [B]; k_ring, v_ring: [B, Hkv, W, D], the
    last W positions' keys and values, position p in slot p % W. Rotates q and k (rotate-half RoPE), writes k and
    v to their slot, and attends to every filled slot (softmax does not care about order; slots after the
    position are empty while it is < W - 1); scale None: D^-0.5. Returns [B, H * D] in qkv's dtype. One kernel
    on the GPU (RoPE in fp32 there; the twin rotates in qkv's dtype as the official code does)."""
    B = qkv.shape[0]
    _, num_kv, W, D = k_ring.shape
    if not use_triton(qkv):
        return _ring_attention_step_ref(qkv, positions, k_ring, v_ring, inv_freq, num_heads, scale)
    out = torch.empty(B, num_heads * D, dtype=qkv.dtype, device=qkv.device)
    _ring_attention_kernel[(B, num_heads)](
        qkv, positions, k_ring, v_ring, inv_freq, out, D**-0.5 if scale is None else scale, k_ring.stride(0),
        k_ring.stride(1), W, NUM_HEADS=num_heads, NUM_KV=num_kv, D=D, BLOCK_W=triton.next_power_of_2(W),
        num_warps=4)
    return out


def _ring_attention_step_ref(qkv, positions, k_ring, v_ring, inv_freq, num_heads, scale):
    B = qkv.shape[0]
    _, num_kv, W, D = k_ring.shape
    cos, sin = (c.to(qkv.dtype)[:, :, None] for c in rope_cos_sin(positions[:, None], inv_freq))  # [B, 1, 1, D]
    q, k, v = split_rotate(qkv.view(B, 1, num_heads + 2 * num_kv, D), cos, sin, num_heads)
    slot = (positions % W)[:, None, None, None].expand(B, num_kv, 1, D)
    keys, values = k_ring.scatter_(2, slot, k), v_ring.scatter_(2, slot, v)
    visible = (torch.arange(W, device=qkv.device) <= positions[:, None])[:, None, None, :]
    return attend(q, keys, values, visible, scale).transpose(1, 2).reshape(B, num_heads * D)


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [B, T, H + 2 Hkv, D]; cos, sin: [B, T, 1, D] in qkv's dtype -> q [B, H, T, D], k and v [B, Hkv, T, D],
    q and k rotated (rotate-half) in qkv's dtype, as the official code rounds them."""
    num_kv = (qkv.shape[2] - num_heads) // 2
    qk = qkv[:, :, :num_heads + num_kv]
    qk = qk * cos + rotate_half(qk) * sin
    v = qkv[:, :, num_heads + num_kv:]
    return qk[:, :, :num_heads].transpose(1, 2), qk[:, :, num_heads:].transpose(1, 2), v.transpose(1, 2)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
           scale: float | None) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over keys and values [B, Hkv, S, D], each KV head serving H / Hkv query heads."""
    if keys.shape[1] != q.shape[1]:
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale)


if triton is not None:
    @triton.jit
    def _ring_attention_kernel(qkv_ptr, pos_ptr, k_ptr, v_ptr, inv_freq_ptr, out_ptr, scale, ring_s0, ring_s1, W,
                               NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr,
                               BLOCK_W: tl.constexpr):
        # One program per (row, query head); W x D multiply-adds, no tensor cores needed.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        kv = h // (NUM_HEADS // NUM_KV)
        half = tl.arange(0, D // 2)
        base = qkv_ptr + b * (NUM_HEADS + 2 * NUM_KV) * D
        pos = tl.load(pos_ptr + b)
        freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)
        cos, sin = tl.cos(freqs), tl.sin(freqs)
        q1 = tl.load(base + h * D + half).to(tl.float32)
        q2 = tl.load(base + h * D + D // 2 + half).to(tl.float32)
        q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
        k1 = tl.load(base + (NUM_HEADS + kv) * D + half).to(tl.float32)
        k2 = tl.load(base + (NUM_HEADS + kv) * D + D // 2 + half).to(tl.float32)
        k1, k2 = (k1 * cos - k2 * sin).to(k_ptr.dtype.element_ty), (k2 * cos + k1 * sin).to(k_ptr.dtype.element_ty)
        v1 = tl.load(base + (NUM_HEADS + NUM_KV + kv) * D + half)
        v2 = tl.load(base + (NUM_HEADS + NUM_KV + kv) * D + D // 2 + half)
        slot = pos % W
        ring = b * ring_s0 + kv * ring_s1
        if h % (NUM_HEADS // NUM_KV) == 0:  # one writer per KV head
            tl.store(k_ptr + ring + slot * D + half, k1)
            tl.store(k_ptr + ring + slot * D + D // 2 + half, k2)
            tl.store(v_ptr + ring + slot * D + half, v1)
            tl.store(v_ptr + ring + slot * D + D // 2 + half, v2)
        w = tl.arange(0, BLOCK_W)
        in_ring = w < W
        rows = ring + w[:, None] * D + half[None, :]
        new = (w == slot)[:, None]  # this frame's slot: from registers (the store above may not be visible)
        K1 = tl.where(new, k1[None, :], tl.load(k_ptr + rows, mask=in_ring[:, None], other=0.0)).to(tl.float32)
        K2 = tl.where(new, k2[None, :], tl.load(k_ptr + rows + D // 2, mask=in_ring[:, None], other=0.0))
        s = tl.sum(K1 * q1[None, :] + K2.to(tl.float32) * q2[None, :], axis=1) * scale  # [BLOCK_W]
        s = tl.where(in_ring & (w <= pos), s, float("-inf"))
        p = tl.exp(s - tl.max(s, axis=0))
        p = p / tl.sum(p, axis=0)
        V1 = tl.where(new, v1[None, :], tl.load(v_ptr + rows, mask=in_ring[:, None], other=0.0)).to(tl.float32)
        V2 = tl.where(new, v2[None, :], tl.load(v_ptr + rows + D // 2, mask=in_ring[:, None], other=0.0))
        o = out_ptr + b * NUM_HEADS * D + h * D
        tl.store(o + half, tl.sum(p[:, None] * V1, axis=0).to(out_ptr.dtype.element_ty))
        tl.store(o + D // 2 + half, tl.sum(p[:, None] * V2.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty))

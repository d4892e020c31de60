"""Small-batch matrix products with their neighbours fused in (Triton): the tensor-core kernel for a few rows and
the matrix-vector kernel for one or two, with the RMSNorm before, SwiGLU or the residual add after; and their
PyTorch twin."""

from __future__ import annotations

import torch

from .backend import pdl_flags, triton, use_triton
from .norm import rmsnorm_ref

if triton is not None:
    import triton.language as tl

# ---- small-batch matrix products with their neighbours fused in -------------------------------------------

# Rows per program of the tensor-core kernel: more rows take more programs per column block.
FUSED_BLOCK_M = 64
# (BLOCK_M, N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, K ranges), the fastest of
# bench/sweeps/fused_linear.py's candidates per shape of the 0.6B and 1.7B layers and heads on an H100
# (docs/perf-notes.md, entries 38 and 69); other shapes take the heuristic in fused_linear_tiles. K ranges: the K
# columns split among that many programs per column block (their sums added by the last to finish): the products of few
# columns and long rows (o, down) would otherwise leave most SMs without weights to read.
FUSED_LINEAR_TILES: dict[tuple[int, int, int, bool], tuple[int, int, int, int, int]] = {
    (16, 1024, 2048, False): (32, 256, 4, 3, 4),
    (16, 1024, 3072, False): (16, 128, 4, 3, 4),
    (16, 2048, 1024, False): (16, 256, 4, 3, 1),
    (16, 2048, 2048, False): (64, 256, 4, 3, 4),
    (16, 2048, 6144, False): (64, 256, 4, 3, 4),
    (16, 3072, 1024, True): (32, 256, 4, 3, 1),
    (16, 3072, 2048, False): (32, 128, 4, 3, 4),
    (16, 4096, 1024, False): (32, 512, 4, 3, 1),
    (16, 4096, 2048, False): (32, 512, 4, 3, 1),
    (16, 6144, 2048, True): (64, 256, 4, 3, 1),
}

# A row or two (one stream's decode step, its code predictor's first pass) take a matrix-vector kernel instead:
# no tensor cores, so a program can own as few as one output column and even the code predictor's N = 1024 products
# spread over every SM. (N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest of
# bench/sweeps/fused_linear.py's candidates with the weights read from memory, at one row (GEMV_TILES,
# docs/perf-notes.md entry 49) and at two (GEMV_TWO_ROW_TILES, entry 54; shapes not there take the one-row tiles); other
# shapes take _gemv_tiles' heuristic.
GEMV_MAX_ROWS = 2
GEMV_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (1024, 2048, False): (1, 1024, 8, 3),
    (1024, 3072, False): (1, 256, 4, 2),
    (2048, 1024, False): (8, 512, 8, 3),  # (the code predictor's heads)
    (2048, 2048, False): (2, 1024, 4, 2),
    (2048, 6144, False): (1, 256, 4, 2),
    (3072, 1024, False): (2, 1024, 4, 2),  # (0.6B's talker head)
    (3072, 1024, True): (4, 256, 4, 2),
    (3072, 2048, False): (2, 1024, 4, 2),  # (1.7B's talker head)
    (4096, 1024, False): (8, 512, 4, 2),
    (4096, 2048, False): (8, 512, 8, 3),
    (6144, 2048, True): (1, 1024, 4, 4),
}
GEMV_TWO_ROW_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (1024, 2048, False): (1, 512, 4, 2),
    (1024, 3072, False): (1, 512, 8, 2),
    (2048, 1024, False): (2, 512, 4, 2),
    (3072, 1024, False): (4, 512, 4, 2),
    (3072, 1024, True): (4, 256, 4, 2),
    (3072, 2048, False): (4, 512, 4, 2),
    (4096, 1024, False): (8, 512, 4, 2),
}


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0,
                 swiglu: bool = False, residual: torch.Tensor | None = None, fp32_out: bool = False,
                 squares: torch.Tensor | None = None, squares_out: bool = False,
                 pdl: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """x @ weight.T for a few tokens (weight: [N, K], nn.Linear's layout) with what surrounds it in a decoder
    layer done in the same kernel, in the weights' dtype with fp32 accumulation (each program reads all the rows
    or FUSED_BLOCK_M of them: meant for decode steps, see decoder.FUSED_MAX_ROWS):
      * norm: x is the residual stream (fp32; a first layer's input in any float dtype, read as fp32); it is
        RMS-normalised (eps, then times `norm`) and cast to the weights' dtype first, as add_rmsnorm does;
      * swiglu: weight is gate/up stacked ([2 I, K]); returns silu(gate) * up [M, I], as silu_mul does on the
        product's output;
      * residual: returns the new fp32 residual stream, residual (any float dtype, read as fp32) + the product
        (rounded to the weights' dtype first, as F.linear's output is).
    Otherwise returns the product [M, N] in the weights' dtype, or with `fp32_out` in fp32 without that rounding
    (as torch.mm(..., out_dtype=torch.float32): the heads' logits). Same operations and roundings as the unfused
    kernels; only the order of the fp32 sums inside the product differs from cuBLAS's. `pdl`: launched with PDL
    (see PDL above).

    More than GEMV_MAX_ROWS rows take the tensor-core kernel, whose programs each read every row: there the norm
    takes its rows' sums of squares from `squares` ([P, M] fp32 partial sums, added in order; from `row_squares`
    or from the product that made x, with `squares_out`) instead of reading the rows twice, and `squares_out`
    (with `residual`) returns (the new residual stream, its partial sums of squares); on the matrix-vector kernel
    the norm reads its row or two itself, `squares` is not needed and `squares_out` gives None."""
    if fp32_out and (swiglu or residual is not None):
        raise ValueError("fp32_out is for the plain product")
    if squares_out and residual is None:
        raise ValueError("squares_out is for a product with a residual add")
    if squares is not None and norm is None:
        raise ValueError("squares are the normed input's (norm)")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    M, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    dtype = weight.dtype
    if not use_triton(x):
        out = fused_linear_ref(x, weight, norm, eps, swiglu, residual, fp32_out)
        return (out, _row_squares_ref(out)) if squares_out else out
    out = torch.empty(M, N, dtype=torch.float32 if residual is not None or fp32_out else dtype, device=x.device)
    args = (x, weight, out, norm if norm is not None else weight, residual if residual is not None else out,
            M, N, K, eps)
    flags = dict(NORM=norm is not None, SWIGLU=swiglu, RESIDUAL=residual is not None, ROUND=not fp32_out,
                 **pdl_flags(x, pdl))
    if M <= GEMV_MAX_ROWS:
        BLOCK_N, BLOCK_K, warps, stages = _gemv_tiles(N, K, swiglu, M)
        _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](
            *args, TWO=M == 2, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            K_ALL=triton.next_power_of_2(K) if norm is not None else 1, num_warps=warps, num_stages=stages, **flags)
        return (out, None) if squares_out else out
    BLOCK_M = min(FUSED_BLOCK_M, max(16, triton.next_power_of_2(M)))
    BLOCK_N, BLOCK_K, warps, stages, split = fused_linear_tiles(BLOCK_M, N, K, swiglu)
    k_split = triton.cdiv(triton.cdiv(K, split), BLOCK_K) * BLOCK_K  # (each program's K range, whole K tiles)
    # (a column block's row blocks and K ranges run side by side)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), triton.cdiv(K, k_split))
    sq_in = out if squares is None else squares  # (out: a placeholder, not read)
    sq_out = torch.empty(grid[1], M, dtype=torch.float32, device=x.device) if squares_out else out
    partial, arrivals = out, out  # (placeholders, not read without SPLIT)
    if grid[2] > 1:
        partial = torch.empty(grid[2], M, 2 * N if swiglu else N, dtype=torch.float32, device=x.device)
        arrivals = split_arrivals(x.device, grid[0] * grid[1])
    _fused_linear_kernel[grid](
        *args, sq_in, sq_in.stride(0), sq_in.stride(1), sq_out, 0 if squares is None else squares.shape[0],
        partial, arrivals, k_split, SQ_IN=squares is not None, SQ_OUT=squares_out, SPLIT=grid[2] > 1,
        IEEE=dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=warps,
        num_stages=stages, **flags)
    return (out, sq_out) if squares_out else out


def row_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares (read as fp32): [1, M] fp32, fused_linear's `squares` for a first layer."""
    if not use_triton(x):
        return _row_squares_ref(x)
    M, K = x.shape
    out = torch.empty(1, M, dtype=torch.float32, device=x.device)
    _row_squares_kernel[(M,)](x.contiguous(), out, K, BLOCK=triton.next_power_of_2(K), num_warps=4)
    return out


def _row_squares_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float().pow(2).sum(-1)[None]


def fused_linear_tiles(BLOCK_M: int, N: int, K: int, swiglu: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages, split) of a fused product: the tuned FUSED_LINEAR_TILES entry, else the
    heuristic (public for the kernel tests, which pin and replace it)."""
    tiles = FUSED_LINEAR_TILES.get((BLOCK_M, N, K, swiglu))
    if tiles is not None:
        return tiles
    # (an fp32 [BLOCK_M, BLOCK_K] input tile per stage: 512 columns at 16 rows, fewer as the rows grow, within an
    # H100's shared memory; the 64-row default of 512 did not fit, perf-notes 55)
    BLOCK_K = min(512 if K % 512 == 0 else 128, max(16, 8192 // BLOCK_M), triton.next_power_of_2(K))
    return (16 if N <= 2048 else 32), BLOCK_K, 4, 3, 1


def split_arrivals(device: torch.device, programs: int) -> torch.Tensor:
    """Zeroed int32 counters for a split product's column blocks (each program of a block adds one as it leaves
    its partial sums; the last one sums them and sets the counter back to zero), one set per stream: products on
    one stream run one after another, those on two streams (two engines' graphs) may overlap. The sets are made
    zeroed together, by a device's first split product outside a graph capture, so that a stream first seen
    while capturing (torch.cuda.graph captures on a stream of its own) takes one without allocating."""
    if programs > ARRIVALS_PER_STREAM:
        raise ValueError(f"a split product of {programs} column blocks; at most {ARRIVALS_PER_STREAM}")
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counters = _ARRIVALS.get(key)
    if counters is None:
        bank = _ARRIVAL_SETS.get(device)
        if bank is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a device's first split product must run outside a CUDA graph capture")
            bank = _ARRIVAL_SETS[device] = list(torch.zeros(ARRIVAL_SETS, ARRIVALS_PER_STREAM, dtype=torch.int32,
                                                            device=device).unbind())
        if not bank:
            raise RuntimeError(f"split products on more than {ARRIVAL_SETS} streams of one device")
        counters = _ARRIVALS[key] = bank.pop()
    return counters


ARRIVAL_SETS, ARRIVALS_PER_STREAM = 256, 4096  # (4 MB per device)
_ARRIVAL_SETS: dict[torch.device, list[torch.Tensor]] = {}
_ARRIVALS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _gemv_tiles(N: int, K: int, swiglu: bool, rows: int = 1) -> tuple[int, int, int, int]:
    tiles = (GEMV_TWO_ROW_TILES.get((N, K, swiglu)) if rows == 2 else None) or GEMV_TILES.get((N, K, swiglu))
    if tiles is not None:
        return tiles
    # ~2-6 programs per SM of an H100 for the layers' shapes, a K tile of up to 1 KB of each weight row
    return min(8, max(1, triton.next_power_of_2(N) // 512)), min(512, triton.next_power_of_2(K)), 4, 3


def fused_linear_ref(x, weight, norm, eps, swiglu, residual, fp32_out=False):
    """The PyTorch twin of the fused product (norm, product, SwiGLU, residual), run where the kernel is not; public
    for the tests and bench/sweeps/fused_linear.py, which check the kernel against it."""
    dtype = weight.dtype
    y = x.to(dtype) if norm is None else rmsnorm_ref(x, norm, eps).to(dtype)
    if fp32_out:
        return y.float() @ weight.float().t()
    product = torch.nn.functional.linear(y, weight)
    if swiglu:
        g, u = product.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(dtype)
    if residual is not None:
        return residual + product.float()
    return product


if triton is not None:
    @triton.jit
    def _linear_epilogue(acc, acc_up, out_ptr, res_ptr, offs, mask, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                         ROUND: tl.constexpr, dtype: tl.constexpr):
        """The fused products' last step, from the fp32 sums (`acc_up`: SwiGLU's up half): the product rounded to
        the weights' dtype (unless not ROUND), then SwiGLU, the residual add or nothing, and the store. Returns
        what it stored, in fp32."""
        y = acc
        if ROUND:
            y = y.to(dtype).to(tl.float32)
        if SWIGLU:
            up = acc_up.to(dtype).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * up
        elif RESIDUAL:
            y = tl.load(res_ptr + offs, mask=mask, other=0.0) + y
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        return y

    @triton.jit
    def _fused_linear_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, M, N, K, eps, sq_in_ptr, sq_stride_p,
                             sq_stride_m, sq_out_ptr, P, partial_ptr, arrivals_ptr, K_SPLIT,
                             NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr,
                             SQ_IN: tl.constexpr, SQ_OUT: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        # One program per BLOCK_N output columns, BLOCK_M tokens (padded for the tensor cores) and K_SPLIT of the
        # K columns: the weights are read from memory once (a column block's row blocks and K ranges run side by
        # side), which is what bounds a product of a few dozen tokens. SPLIT (more than one K range): each program
        # leaves its fp32 sums at partial [K range, M, N (2 N with SWIGLU)] and counts itself in at arrivals
        # [row block, column block]; the last of a block to arrive adds the ranges' sums in order (the same
        # result whichever arrives last), finishes the product and sets the counter back to zero. SQ_IN: the
        # norm's sums of squares are the P partial sums at sq_in [P, M], added in order (strides sq_stride_p,
        # sq_stride_m); SQ_OUT: this column block's partial sums of squares of the residual stream it wrote, at
        # sq_out [column block, M].
        pid_n = tl.program_id(1)
        if PDL:  # (see PDL above)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        m_in, n_in = m < M, n < N
        dtype = w_ptr.dtype.element_ty
        if NORM:
            squares = tl.zeros([BLOCK_M], tl.float32)
            if SQ_IN:
                p = tl.arange(0, 16)
                for p0 in range(0, P, 16):
                    part = tl.load(sq_in_ptr + (p0 + p)[:, None] * sq_stride_p + m[None, :] * sq_stride_m,
                                   mask=(p0 + p < P)[:, None] & m_in[None, :], other=0.0)
                    squares += tl.sum(part, axis=0)
            else:
                for k0 in range(0, K, BLOCK_K):
                    xs = tl.load(x_ptr + m[:, None] * K + (k0 + k)[None, :],
                                 mask=m_in[:, None] & (k0 + k < K)[None, :], other=0.0).to(tl.float32)
                    squares += tl.sum(xs * xs, axis=1)
            inv = tl.rsqrt(squares / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if SWIGLU:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = tl.program_id(2) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
            kk = k0 + k
            k_in = kk < K
            a = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=m_in[:, None] & k_in[None, :], other=0.0)
            if NORM:
                w_norm = tl.load(norm_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
                a = a.to(tl.float32) * inv[:, None] * w_norm[None, :]
            a = a.to(dtype)
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
            if SWIGLU:
                w = tl.load(w_ptr + (N + n)[:, None] * K + kk[None, :], mask=n_in[:, None] & k_in[None, :],
                            other=0.0)
                if IEEE:
                    acc_up += tl.dot(a, tl.trans(w), input_precision="ieee")
                else:
                    acc_up += tl.dot(a, tl.trans(w))
        if not SWIGLU:
            acc_up = acc  # (unused)
        mask = m_in[:, None] & n_in[None, :]
        rows_done = m_in
        if SPLIT:
            width = 2 * N if SWIGLU else N
            offs = m[:, None] * width + n[None, :]
            tl.store(partial_ptr + tl.program_id(2) * M * width + offs, acc, mask=mask)
            if SWIGLU:
                tl.store(partial_ptr + tl.program_id(2) * M * width + N + offs, acc_up, mask=mask)
            tl.debug_barrier()  # (every thread's sums stored before the count: released with it)
            arrival = arrivals_ptr + tl.program_id(0) * tl.num_programs(1) + pid_n
            last = tl.atomic_add(arrival, 1, sem="acq_rel") == tl.num_programs(2) - 1
            mask = mask & last  # (the others are done: no load or store below is issued for them)
            rows_done = m_in & last
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in range(0, tl.num_programs(2)):
                acc += tl.load(partial_ptr + part * M * width + offs, mask=mask, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(partial_ptr + part * M * width + N + offs, mask=mask, other=0.0,
                                      cache_modifier=".cg")
            tl.store(arrival, 0, mask=last)
        y = _linear_epilogue(acc, acc_up, out_ptr, res_ptr, m[:, None] * N + n[None, :], mask, SWIGLU, RESIDUAL,
                             ROUND, dtype)
        if SQ_OUT:
            tl.store(sq_out_ptr + pid_n * M + m, tl.sum(tl.where(mask, y * y, 0.0), axis=1), mask=rows_done)

    @triton.jit
    def _row_squares_kernel(x_ptr, out_ptr, K, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(out_ptr + row, tl.sum(x * x, axis=0))

    @triton.jit
    def _gemv_input(x_ptr, kk, k_in, inv, norm_ptr, NORM: tl.constexpr, dtype: tl.constexpr):
        """One row's K tile of the product's input, normalised (`inv`: its 1 / RMS) and rounded as the product
        takes it, in fp32 [1, BLOCK_K]."""
        a = tl.load(x_ptr + kk, mask=k_in, other=0.0)
        if NORM:
            a = a.to(tl.float32) * inv * tl.load(norm_ptr + kk, mask=k_in, other=0.0).to(tl.float32)
        return a.to(dtype).to(tl.float32)[None, :]

    @triton.jit
    def _inv_rms(x_ptr, K, eps, NORM: tl.constexpr, K_ALL: tl.constexpr):
        if NORM:
            k_all = tl.arange(0, K_ALL)
            xs = tl.load(x_ptr + k_all, mask=k_all < K, other=0.0).to(tl.float32)
            return tl.rsqrt(tl.sum(xs * xs, axis=0) / K + eps)
        return 1.0

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, M, N, K, eps, NORM: tl.constexpr,
                     SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr, TWO: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ALL: tl.constexpr, PDL: tl.constexpr):
        # _fused_linear_kernel for one row (or with TWO, two rows: each weight tile read once for both), on the
        # CUDA cores: a [BLOCK_N, BLOCK_K] tile of products per step and row, summed over K once at the end. The
        # same roundings (the normalised input and the product cast to the weights' dtype); only the order of the
        # fp32 sums differs.
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PDL:  # (see PDL above)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        k = tl.arange(0, BLOCK_K)
        n_in = n < N
        dtype = w_ptr.dtype.element_ty
        inv = _inv_rms(x_ptr, K, eps, NORM, K_ALL)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if SWIGLU:
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if TWO:
            inv1 = _inv_rms(x_ptr + K, K, eps, NORM, K_ALL)
            acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            if SWIGLU:
                acc_up1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            k_in = kk < K
            w_mask = n_in[:, None] & k_in[None, :]
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
            a = _gemv_input(x_ptr, kk, k_in, inv, norm_ptr, NORM, dtype)
            acc += w * a
            if TWO:
                a1 = _gemv_input(x_ptr + K, kk, k_in, inv1, norm_ptr, NORM, dtype)
                acc1 += w * a1
            if SWIGLU:
                w = tl.load(w_ptr + (N + n)[:, None] * K + kk[None, :], mask=w_mask, other=0.0).to(tl.float32)
                acc_up += w * a
                if TWO:
                    acc_up1 += w * a1
        y = tl.sum(acc, axis=1)
        up = y  # (unused without SWIGLU)
        if SWIGLU:
            up = tl.sum(acc_up, axis=1)
        _linear_epilogue(y, up, out_ptr, res_ptr, n, n_in, SWIGLU, RESIDUAL, ROUND, dtype)
        if TWO:
            y = tl.sum(acc1, axis=1)
            up = y
            if SWIGLU:
                up = tl.sum(acc_up1, axis=1)
            _linear_epilogue(y, up, out_ptr, res_ptr, N + n, n_in, SWIGLU, RESIDUAL, ROUND, dtype)

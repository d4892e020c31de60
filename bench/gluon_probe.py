"""Probe: the persistent multi-layer kernel of entry 79 with its weights streamed ahead across the grid barriers
(issue 13 item 1, docs/perf-notes.md entries 79-80).

Entry 79's Triton kernel waits, in each phase, for each weight tile it has just asked for. Here (Gluon, Hopper) each
program walks one flat stream of its weight tiles over all phases and layers: a ring of NS shared-memory slots
filled by TMA, NS tiles ahead of the product that reads them, so the next phase's first tiles are on their way while
the program finishes its phase and waits at the barrier (the weights do not depend on anything a phase computes).
The activations a product reads (its [64, K] input) come by TMA too, all of an item's chunks asked for at once right
after the barrier; products on the tensor cores (warpgroup MMA, the input from shared memory).

Same work, shapes and phases as `bench/persistent_probe.py` (the 1.7B code predictor's five layers less the
attention, 64 rows): qkv; o split over K into fp32 partial sums; the partial sums added in order to the residual
stream and normed; gate/up with SwiGLU; down split over K; the second norm. Each program takes at most one item per
phase (the items of a phase are at most the programs), so its tile stream is known from its id alone.

Gluon has no CPU interpreter: this runs on a Hopper GPU only (compile-check elsewhere with --compile-only).

usage: python bench/gluon_probe.py [--rows 64] [--layers 5] [--stages 8,16] [--bn 32] [--bk 64]
       python bench/gluon_probe.py --compile-only   (any machine with Triton: compiles for sm_90)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
from persistent_probe import Layers, graph_ms  # noqa: E402

MAX_SPINS = gl.constexpr(1 << 22)  # a barrier gives up (raising the error flag) instead of hanging the GPU


@gluon.jit
def _proxy_fence():
    """Orders this thread's ordinary global accesses with the TMA's (the async proxy) on global memory."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _load_acquire(ptr):
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _grid_barrier(sync_ptr, target, SPIN_LOAD: gl.constexpr):
    """All programs arrive (release) and wait for the count (acquire); SPIN_LOAD polls with loads rather than
    atomics."""
    gl.thread_barrier()
    _proxy_fence()
    gl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    spins = 0
    if SPIN_LOAD:
        while (_load_acquire(sync_ptr) < target) & (spins < MAX_SPINS):
            spins += 1
    else:
        while (gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPINS):
            spins += 1
    if spins >= MAX_SPINS:
        gl.store(sync_ptr + 2, 1)
    _proxy_fence()
    gl.thread_barrier()


@gluon.jit
def _items(j, H: gl.constexpr, W: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, S_O: gl.constexpr,
           S_D: gl.constexpr):
    """Items of product j (0 qkv, 1 o, 2 gate/up, 3 down)."""
    return (j == 0) * (W // BN) + (j == 1) * ((H // BN) * S_O) + (j == 2) * (INTER // BN) + (j == 3) * ((H // BN) * S_D)


@gluon.jit
def _tiles(j, H: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr, BK: gl.constexpr, S_O: gl.constexpr,
           S_D: gl.constexpr):
    """Weight tiles of one item of product j (gate/up: a gate tile and an up tile per K chunk)."""
    return ((j == 0) * (H // BK) + (j == 1) * (HQ // S_O // BK) + (j == 2) * (2 * (H // BK))
            + (j == 3) * (INTER // S_D // BK))


@gluon.jit
def _next_product(f, pid, L: gl.constexpr, H: gl.constexpr, W: gl.constexpr, INTER: gl.constexpr,
                  BN: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr):
    """The next product (layer * 4 + j) after f that has an item for this program; 4 * L when none is left."""
    f += 1
    while (f < 4 * L) & (pid >= _items(f % 4, H, W, INTER, BN, S_O, S_D)):
        f += 1
    return f


@gluon.jit
def _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS: gl.constexpr, H: gl.constexpr,
           W: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
           S_O: gl.constexpr, S_D: gl.constexpr, L: gl.constexpr):
    """Asks for the producer cursor's tile (product f, tile pc) into ring slot ti % NS, then advances the cursor."""
    if f < 4 * L:
        layer = f // 4
        j = f % 4
        slot = ti % NS
        bar = bars.index(slot)
        dst = ring.index(slot)
        mbarrier.expect(bar, BN * BK * 2)
        nb = pid % (H // BN)
        if j == 0:
            tma.async_copy_global_to_shared(d_qkv, [layer * W + pid * BN, pc * BK], bar, dst)
        elif j == 1:
            tma.async_copy_global_to_shared(d_o, [layer * H + nb * BN, (pid // (H // BN)) * (HQ // S_O) + pc * BK],
                                            bar, dst)
        elif j == 2:
            tma.async_copy_global_to_shared(d_gu, [layer * 2 * INTER + (pc % 2) * INTER + pid * BN, (pc // 2) * BK],
                                            bar, dst)
        else:
            tma.async_copy_global_to_shared(d_d, [layer * H + nb * BN,
                                                  (pid // (H // BN)) * (INTER // S_D) + pc * BK], bar, dst)
        ti += 1
        pc += 1
        if pc == _tiles(j, H, HQ, INTER, BK, S_O, S_D):
            pc = 0
            f = _next_product(f, pid, L, H, W, INTER, BN, S_O, S_D)
    return f, pc, ti


@gluon.jit
def _load_input(x_desc, k0, n_chunks, x_smem, x_bars, M: gl.constexpr, BK: gl.constexpr):
    for c in range(n_chunks):
        mbarrier.expect(x_bars.index(c), M * BK * 2)
        tma.async_copy_global_to_shared(x_desc, [0, k0 + c * BK], x_bars.index(c), x_smem.index(c))


@gluon.jit
def _norm_rows(part_ptr, res_ptr, norm_ptr, xn_ptr, pid, P, eps, S: gl.constexpr, M: gl.constexpr,
               H: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([H // (32 * num_warps)], [32], [num_warps], [0])
    cols = gl.arange(0, H, layout=layout)
    for r in range(pid, M, P):
        row = gl.load(res_ptr + r * H + cols)
        for s in range(S):
            row += gl.load(part_ptr + (s * M + r) * H + cols)
        gl.store(res_ptr + r * H + cols, row)
        inv = gl.rsqrt(gl.sum(row * row, axis=0) / H + eps)
        y = row * inv * gl.load(norm_ptr + cols).to(gl.float32)
        gl.store(xn_ptr + r * H + cols, y.to(gl.bfloat16))


@gluon.jit
def _clock():
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _product(n_chunks, x_smem, x_bars, xph, acc, tc, f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d,
             NS: gl.constexpr, M: gl.constexpr, H: gl.constexpr, W: gl.constexpr, HQ: gl.constexpr,
             INTER: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr,
             L: gl.constexpr, LAG: gl.constexpr):
    """acc += x[:, k0:k0 + n_chunks * BK] @ (the next n_chunks tiles of the ring)^T; each slot refilled (the
    stream's tile NS ahead) once the product that read it is done: at once (LAG 0) or one product later (LAG 1).
    The input's chunks were asked for (`_load_input`)."""
    for c in range(n_chunks):
        mbarrier.wait(x_bars.index(c), (xph >> c) & 1)
        mbarrier.wait(bars.index(tc % NS), (tc // NS) & 1)
        acc = warpgroup_mma(x_smem.index(c), ring.index(tc % NS).permute((1, 0)), acc, is_async=True)
        tc += 1
        acc = warpgroup_mma_wait(num_outstanding=LAG, deps=(acc, ))
        if c >= LAG:
            f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ, INTER, BN, BK, S_O,
                               S_D, L)
    if LAG:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ, INTER, BN, BK, S_O, S_D,
                           L)
    xph ^= (1 << n_chunks) - 1
    return acc, xph, tc, f, pc, ti


@gluon.jit
def _fold_partials(acc, part_ptr, res_ptr, rb_ptr, sq_ptr, cnt_ptr, nb, s, rows, cols, S: gl.constexpr,
                   M: gl.constexpr, H: gl.constexpr, BN: gl.constexpr):
    """Stores this item's partial sums; the last of the S items of column block nb to arrive adds the S partials in
    order to the residual stream, and writes the block in bf16 (the next products' input, whose RMS norm they apply
    to their results) and its per-row sums of squares."""
    offs = rows[:, None] * H + (nb * BN + cols)[None, :]
    gl.store(part_ptr + s * M * H + offs, acc)
    gl.thread_barrier()
    if gl.atomic_add(cnt_ptr + nb, 1, sem="acq_rel", scope="gpu") % S == S - 1:
        r = gl.load(res_ptr + offs)
        for t in gl.static_range(S):
            r += gl.load(part_ptr + t * M * H + offs)
        gl.store(res_ptr + offs, r)
        gl.store(rb_ptr + offs, r.to(gl.bfloat16))
        gl.store(sq_ptr + nb * M + rows, gl.sum(r * r, axis=1))


@gluon.jit
def _row_scale(sq_ptr, eps, M: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, acc_layout: gl.constexpr,
               num_warps: gl.constexpr):
    """1 / RMS of each row, from the column blocks' sums of squares, in the products' row layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [num_warps, 1], [1, 0])
    i = gl.arange(0, H // BN, layout=gl.SliceLayout(1, layout))
    j = gl.arange(0, M, layout=gl.SliceLayout(0, layout))
    total = gl.sum(gl.load(sq_ptr + i[:, None] * M + j[None, :]), axis=0)
    return gl.convert_layout(gl.rsqrt(total / H + eps), gl.SliceLayout(1, acc_layout))


@gluon.jit
def _layers_kernel(d_qkv, d_o, d_gu, d_d, x_xn, x_qkv, x_xn2, x_h, xn_ptr, res_ptr, qkv_ptr, xn2_ptr, h_ptr,
                   part_ptr, n1_ptr, n2_ptr, sync_ptr, times_ptr, rb_ptr, sq_ptr, cnt_ptr, eps, M: gl.constexpr,
                   H: gl.constexpr, W: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr, L: gl.constexpr,
                   BN: gl.constexpr, BK: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr, NS: gl.constexpr,
                   KC: gl.constexpr, LAG: gl.constexpr, TIMING: gl.constexpr, FOLD: gl.constexpr,
                   SPIN_LOAD: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, BK], d_qkv.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [KC, M, BK], x_xn.layout)
    x_bars = gl.allocate_shared_memory(gl.int64, [KC, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(KC):
        mbarrier.init(x_bars.index(i), count=1)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))

    # the producer cursor: product f (layer * 4 + j), its tile pc, tiles issued ti; the first NS tiles asked for now
    f = _next_product(-1, pid, L, H, W, INTER, BN, S_O, S_D)
    pc = 0
    ti = 0
    for _ in range(NS):
        f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ, INTER, BN, BK, S_O,
                           S_D, L)
    tc = 0  # tiles consumed
    xph = 0  # the input barriers' phases, one bit per chunk
    nb = pid % (H // BN)
    s = pid // (H // BN)
    NPH: gl.constexpr = 4 if FOLD else 6  # phases per layer (folded: no norm phases)
    phase = 0
    for layer in range(L):
        for kind in gl.static_range(6):
            if not (FOLD and (kind == 2 or kind == 5)):
                if TIMING:
                    gl.store(times_ptr + (pid * 6 * L + phase) * 2, _clock())
                if kind == 0:  # qkv = xn Wqkv^T (folded: rb (W * norm)^T / rms)
                    if pid < W // BN:
                        _load_input(x_xn, 0, H // BK, x_smem, x_bars, M, BK)
                        acc = gl.zeros([M, BN], gl.float32, acc_layout)
                        acc, xph, tc, f, pc, ti = _product(H // BK, x_smem, x_bars, xph, acc, tc, f, pc, ti, pid,
                                                           ring, bars, d_qkv, d_o, d_gu, d_d, NS, M, H, W, HQ, INTER,
                                                           BN, BK, S_O, S_D, L, LAG)
                        if FOLD:
                            acc = acc * _row_scale(sq_ptr, eps, M, H, BN, acc_layout, num_warps)[:, None]
                        gl.store(qkv_ptr + rows[:, None] * W + (pid * BN + cols)[None, :], acc.to(gl.bfloat16))
                elif kind == 1:  # o = q Wo^T, K split in S_O ranges: fp32 partial sums
                    if pid < (H // BN) * S_O:
                        _load_input(x_qkv, s * (HQ // S_O), HQ // S_O // BK, x_smem, x_bars, M, BK)
                        acc = gl.zeros([M, BN], gl.float32, acc_layout)
                        acc, xph, tc, f, pc, ti = _product(HQ // S_O // BK, x_smem, x_bars, xph, acc, tc, f, pc, ti,
                                                           pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, M, H, W, HQ,
                                                           INTER, BN, BK, S_O, S_D, L, LAG)
                        if FOLD:
                            _fold_partials(acc, part_ptr, res_ptr, rb_ptr, sq_ptr, cnt_ptr + (2 * layer) * (H // BN),
                                           nb, s, rows, cols, S_O, M, H, BN)
                        else:
                            gl.store(part_ptr + (s * M + rows[:, None]) * H + (nb * BN + cols)[None, :], acc)
                elif kind == 2:
                    _norm_rows(part_ptr, res_ptr, n1_ptr + layer * H, xn2_ptr, pid, P, eps, S_O, M, H, num_warps)
                elif kind == 3:  # h = silu(xn2 Wg^T) * (xn2 Wu^T): the stream alternates gate and up tiles
                    if pid < INTER // BN:
                        _load_input(x_xn2, 0, H // BK, x_smem, x_bars, M, BK)
                        g = gl.zeros([M, BN], gl.float32, acc_layout)
                        u = gl.zeros([M, BN], gl.float32, acc_layout)
                        for c in range(H // BK):
                            mbarrier.wait(x_bars.index(c), (xph >> c) & 1)
                            mbarrier.wait(bars.index(tc % NS), (tc // NS) & 1)
                            g = warpgroup_mma(x_smem.index(c), ring.index(tc % NS).permute((1, 0)), g, is_async=True)
                            mbarrier.wait(bars.index((tc + 1) % NS), ((tc + 1) // NS) & 1)
                            u = warpgroup_mma(x_smem.index(c), ring.index((tc + 1) % NS).permute((1, 0)), u,
                                              is_async=True)
                            tc += 2
                            g, u = warpgroup_mma_wait(num_outstanding=2 * LAG, deps=(g, u))
                            if c >= LAG:
                                f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ,
                                                   INTER, BN, BK, S_O, S_D, L)
                                f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ,
                                                   INTER, BN, BK, S_O, S_D, L)
                        if LAG:
                            g, u = warpgroup_mma_wait(num_outstanding=0, deps=(g, u))
                            f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ, INTER,
                                               BN, BK, S_O, S_D, L)
                            f, pc, ti = _issue(f, pc, ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, H, W, HQ, INTER,
                                               BN, BK, S_O, S_D, L)
                        xph ^= (1 << (H // BK)) - 1
                        if FOLD:
                            scale = _row_scale(sq_ptr, eps, M, H, BN, acc_layout, num_warps)[:, None]
                            g = g * scale
                            u = u * scale
                        hv = g / (1.0 + gl.exp(-g)) * u
                        gl.store(h_ptr + rows[:, None] * INTER + (pid * BN + cols)[None, :], hv.to(gl.bfloat16))
                elif kind == 4:  # down, K split in S_D ranges
                    if pid < (H // BN) * S_D:
                        _load_input(x_h, s * (INTER // S_D), INTER // S_D // BK, x_smem, x_bars, M, BK)
                        acc = gl.zeros([M, BN], gl.float32, acc_layout)
                        acc, xph, tc, f, pc, ti = _product(INTER // S_D // BK, x_smem, x_bars, xph, acc, tc, f, pc,
                                                           ti, pid, ring, bars, d_qkv, d_o, d_gu, d_d, NS, M, H, W,
                                                           HQ, INTER, BN, BK, S_O, S_D, L, LAG)
                        if FOLD:
                            _fold_partials(acc, part_ptr, res_ptr, rb_ptr, sq_ptr,
                                           cnt_ptr + (2 * layer + 1) * (H // BN), nb, s, rows, cols, S_D, M, H, BN)
                        else:
                            gl.store(part_ptr + (s * M + rows[:, None]) * H + (nb * BN + cols)[None, :], acc)
                else:
                    _norm_rows(part_ptr, res_ptr, n2_ptr + layer * H, xn_ptr, pid, P, eps, S_D, M, H, num_warps)
                if TIMING:
                    gl.store(times_ptr + (pid * 6 * L + phase) * 2 + 1, _clock())
                phase += 1
                if phase < NPH * L:
                    _grid_barrier(sync_ptr, phase * P, SPIN_LOAD)
    # the last program out leaves the counters at zero for the next launch
    gl.thread_barrier()
    if gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
        gl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")

def _folded(lay: Layers):
    """The folded variant's weights: each RMS norm's weight multiplied into the columns of the product it feeds."""
    before_qkv = torch.cat([lay.ones[None], lay.n2[:-1]]).float()
    w_qkv = (lay.w_qkv.float() * before_qkv[:, None, :]).to(lay.w_qkv.dtype)
    w_gu = (lay.w_gu.float() * lay.n1.float()[:, None, :]).to(lay.w_gu.dtype)
    return w_qkv, w_gu


def _args(lay: Layers, bufs, v, bn, bk, s_o, s_d):
    """The kernel's arguments for variant v (stages, lag, fold, spin, timing)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    w_qkv, w_gu = _folded(lay) if v["fold"] else (lay.w_qkv, lay.w_gu)
    weights = [desc(w.reshape(-1, w.shape[-1]), [bn, bk]) for w in (w_qkv, lay.w_o, w_gu, lay.w_d)]
    first, second = (bufs["rb"], bufs["rb"]) if v["fold"] else (bufs["xn"], bufs["xn2"])
    inputs = [desc(t, [lay.M, bk]) for t in (first, bufs["qkv"], second, bufs["h"])]
    consts = dict(M=lay.M, H=lay.H, W=lay.W, HQ=lay.HQ, INTER=lay.inter, L=lay.L, BN=bn, BK=bk, S_O=s_o, S_D=s_d,
                  NS=v["stages"], KC=max(lay.H, lay.inter // s_d, lay.HQ // s_o) // bk, LAG=v["lag"],
                  TIMING=v["timing"], FOLD=v["fold"], SPIN_LOAD=v["spin"])
    args = (*weights, *inputs, bufs["xn"], bufs["res"], bufs["qkv"], bufs["xn2"], bufs["h"], bufs["part"], lay.n1,
            lay.n2, bufs["sync"], bufs["times"], bufs["rb"], bufs["sq"], bufs["cnt"], lay.eps)
    return args, consts


def _buffers(lay: Layers, s, bn, programs, device):
    bf = lay.w_qkv.dtype
    return dict(xn=torch.empty(lay.M, lay.H, dtype=bf, device=device), res=lay.x0.clone(),
                qkv=torch.empty(lay.M, lay.W, dtype=bf, device=device),
                xn2=torch.empty(lay.M, lay.H, dtype=bf, device=device),
                h=torch.empty(lay.M, lay.inter, dtype=bf, device=device),
                part=torch.empty(s, lay.M, lay.H, dtype=torch.float32, device=device),
                sync=torch.zeros(3, dtype=torch.int32, device=device),
                times=torch.zeros(programs, 6 * lay.L, 2, dtype=torch.int64, device=device),
                rb=torch.empty(lay.M, lay.H, dtype=bf, device=device),
                sq=torch.empty(lay.H // bn, lay.M, dtype=torch.float32, device=device),
                cnt=torch.zeros(2 * lay.L * lay.H // bn, dtype=torch.int32, device=device))


def _check_shapes(lay: Layers, bn, bk, s_o, s_d, programs):
    items = [lay.W // bn, lay.H // bn * s_o, lay.inter // bn, lay.H // bn * s_d]
    assert max(items) <= programs, f"a phase has more items {items} than programs ({programs})"
    assert lay.M == 64 and lay.H % bk == 0 and (lay.HQ // s_o) % bk == 0 and (lay.inter // s_d) % bk == 0


def compile_only(v, bn, bk, s_o, s_d, warps):
    """Compiles the kernel for sm_90 without a GPU (CPU tensors stand in for the arguments' types)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    lay = Layers(64, 1024, 16, 8, 128, 3072, 5, "cpu")
    args, consts = _args(lay, _buffers(lay, max(s_o, s_d), bn, 132, "cpu"), v, bn, bk, s_o, s_d)
    fn = _layers_kernel
    signature, constexprs = {}, {}
    values = dict(zip(fn.arg_names, args)) | consts | {"num_warps": warps}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name == "num_warps":
            signature[name], constexprs[(i,)] = "constexpr", values[name]
        else:
            signature[name] = mangle_type(values[name])
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    print(json.dumps({"compiled": True, **v, "bn": bn, "bk": bk, "shared_bytes": kernel.metadata.shared}))


def _phase_report(times, ms, fold):
    """Per phase kind: the programs' own time in it (median, slowest) and their wait at the barrier after it, in
    us (each program's clock counts its SM's cycles; the cycles per us from the launch's measured time)."""
    names = ["qkv", "o", "gate/up", "down"] if fold else ["qkv", "o", "norm1", "gate/up", "down", "norm2"]
    n = len(names)
    t = times[:, :n * (times.shape[1] // 6)].double()  # [P, phases, 2]: phase start, phase end
    work = t[:, :, 1] - t[:, :, 0]
    wait = t[:, 1:, 0] - t[:, :-1, 1]
    cycles_per_us = (t[:, -1, 1] - t[:, 0, 0]).max().item() / (ms * 1e3)
    kinds = {}
    for k, name in enumerate(names):
        w, b = work[:, k::n] / cycles_per_us, wait[:, k::n] / cycles_per_us
        kinds[name] = {"work_median_us": round(w.median().item(), 2),
                       "work_max_us": round(w.max(0).values.mean().item(), 2),
                       "barrier_wait_median_us": round(b.median().item(), 2)}
    return {"cycles_per_us": round(cycles_per_us, 1), "phases": kinds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--variants", default="16:1:0:0",
                        help="semicolon-separated stages:lag:fold:spin (lag 0 waits for each product, 1 keeps one "
                             "in flight; fold 1 folds the norms into the products; spin 1 polls barriers with loads)")
    parser.add_argument("--bn", type=int, default=32)
    parser.add_argument("--bk", type=int, default=256)
    parser.add_argument("--splits", default="4,4", help="K splits of o and down")
    parser.add_argument("--programs", type=int, default=132)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    s_o, s_d = (int(v) for v in args.splits.split(","))
    variants = [dict(zip(("stages", "lag", "fold", "spin"), (int(x) for x in v.split(":"))), timing=False)
                for v in args.variants.split(";")]
    variants += [dict(variants[-1], timing=True)]
    if args.compile_only:
        for v in variants:
            compile_only(v, args.bn, args.bk, s_o, s_d, args.warps)
        return
    lay = Layers(args.rows, 1024, 16, 8, 128, 3072, args.layers, "cuda")
    _check_shapes(lay, args.bn, args.bk, s_o, s_d, args.programs)
    ref_xn, ref_res = lay.unfused(lay.x0.clone())
    res = lay.x0.clone()
    print(json.dumps({"way": "unfused (cuBLAS + add_rmsnorm + silu_mul)", "ms": graph_ms(lambda: lay.unfused(res))}),
          flush=True)
    from q3tts.engine import kernels
    xn0, _ = kernels.add_rmsnorm(lay.x0, None, lay.ones, lay.eps, lay.w_qkv.dtype)
    rb0 = lay.x0.to(lay.w_qkv.dtype)
    sq0 = lay.x0.reshape(lay.M, lay.H // args.bn, args.bn).pow(2).sum(-1).T.contiguous()
    xn, res2 = torch.empty_like(xn0), lay.x0.clone()
    copies_ms = graph_ms(lambda: (xn.copy_(xn0), res2.copy_(lay.x0)))
    print(json.dumps({"way": "the two resetting copies alone", "ms": copies_ms}), flush=True)
    for v in variants:
        bufs = _buffers(lay, max(s_o, s_d), args.bn, args.programs, "cuda")
        kargs, consts = _args(lay, bufs, v, args.bn, args.bk, s_o, s_d)

        def run(bufs=bufs, kargs=kargs, consts=consts, fold=v["fold"]):
            bufs["xn"].copy_(xn0)
            bufs["res"].copy_(lay.x0)
            if fold:  # (two more copies, small: counted in the time, not in the copies' row)
                bufs["rb"].copy_(rb0)
                bufs["sq"].copy_(sq0)
            _layers_kernel[(args.programs,)](*kargs, **consts, num_warps=args.warps)

        run()
        torch.cuda.synchronize()
        assert bufs["sync"][2].item() == 0, "a barrier timed out"
        err = ((bufs["res"] - ref_res).abs().max() / ref_res.abs().max()).item()
        row = {"way": "gluon persistent, weights streamed ahead", **v, "bn": args.bn, "bk": args.bk,
               "splits": [s_o, s_d], "programs": args.programs, "warps": args.warps, "res_rel_err": round(err, 5),
               "ms": graph_ms(run)}
        if v["timing"]:
            row |= _phase_report(bufs["times"].cpu(), row["ms"] - copies_ms, v["fold"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Probe: would a persistent kernel (several layers' products in one launch, grid barriers between them) beat
cuBLAS plus the kernels around it at 64 rows? (issue 13 item 1, perf-notes 75: no single Triton product beats
cuBLAS there, so what is left is fewer launches.)

The work of the code predictor's decoder layers less the attention, at M rows: per layer qkv = xn Wqkv^T; o = qkv[:,
:Hq] Wo^T; res += o, xn2 = rmsnorm(res); h = silu(xn2 Wg^T) * (xn2 Wu^T); res += h Wd^T, xn = rmsnorm(res). Two ways:

* unfused: what the engine runs at 64 rows today (cuBLAS products, `norm.add_rmsnorm`, `activation.silu_mul`);
* persistent: one launch for all layers; its programs walk six phases per layer (qkv; o split over K into fp32
  partial sums; the partial sums added in order to the residual stream and normed, one row per program; gate/up with
  SwiGLU; down split over K; the second norm), each phase's tiles spread over the programs, a grid barrier (an
  atomic counter) between phases.

Both in CUDA graphs over L layers of distinct weights (the 1.7B code predictor's five: 157 MB, beyond the L2),
median of replays; their outputs compared. On the CPU (TRITON_INTERPRET=1, tiny shapes) a launch per phase stands in
for the barriers, which checks the arithmetic only.

usage: python bench/persistent_probe.py [--rows 64] [--layers 5] [--configs "64,32,4,32,32,4;32,32,4,16,32,4"]
       [--programs 132,264] [--bk 64,128] [--warps 4]      (GPU; results in docs/perf-notes.md, entry 79)
       TRITON_INTERPRET=1 python bench/persistent_probe.py (CPU: the arithmetic only)
       config: BN_qkv, BN_o, splits_o, BN_gate_up, BN_down, splits_down
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from q3tts.kernels import activation, backend, norm

MAX_SPINS = tl.constexpr(1 << 22)  # a barrier gives up (raising the error flag) instead of hanging the GPU


@triton.jit
def _barrier(sync_ptr, target):
    tl.debug_barrier()
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    spins = 0
    while (tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPINS):
        spins += 1
    if spins >= MAX_SPINS:
        tl.store(sync_ptr + 2, 1)
    tl.debug_barrier()


@triton.jit
def _tile(x_ptr, x_stride, w_ptr, K, k_lo, k_hi, n0, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[:, k_lo:k_hi] @ w[n0:n0+BN, k_lo:k_hi]^T, fp32 [M, BN]; w row-major [N, K]."""
    rows = tl.arange(0, M)
    cols = n0 + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    acc = tl.zeros([M, BN], tl.float32)
    for k in range(k_lo, k_hi, BK):
        a = tl.load(x_ptr + rows[:, None] * x_stride + (k + kk)[None, :])
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + (k + kk)[:, None])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _swiglu_tile(x_ptr, w_ptr, K, INTER, n0, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, M)
    cols = n0 + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    g = tl.zeros([M, BN], tl.float32)
    u = tl.zeros([M, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(x_ptr + rows[:, None] * K + (k + kk)[None, :])
        wg = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + (k + kk)[:, None])
        wu = tl.load(w_ptr + (INTER + cols[None, :]).to(tl.int64) * K + (k + kk)[:, None])
        g = tl.dot(a, wg, g)
        u = tl.dot(a, wu, u)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _split_k_phase(x_ptr, x_stride, w_ptr, K, part_ptr, pid, P, M: tl.constexpr, H: tl.constexpr, BN: tl.constexpr,
                   S: tl.constexpr, BK: tl.constexpr):
    """x [M, K] (rows x_stride apart) @ w [H, K]^T with K split in S ranges: range s's fp32 sums into part[s]."""
    for item in range(pid, (H // BN) * S, P):
        nb = item % (H // BN)
        s = item // (H // BN)
        span = K // S
        acc = _tile(x_ptr, x_stride, w_ptr, K, s * span, (s + 1) * span, nb * BN, M, BN, BK)
        cols = nb * BN + tl.arange(0, BN)
        tl.store(part_ptr + (s * M + tl.arange(0, M)[:, None]) * H + cols[None, :], acc)


@triton.jit
def _norm_rows(part_ptr, res_ptr, norm_ptr, xn_ptr, pid, P, eps, S: tl.constexpr, M: tl.constexpr,
               H: tl.constexpr):
    cols = tl.arange(0, H)
    for r in range(pid, M, P):
        row = tl.load(res_ptr + r * H + cols)
        for s in range(S):
            row += tl.load(part_ptr + (s * M + r) * H + cols)
        tl.store(res_ptr + r * H + cols, row)
        inv = tl.rsqrt(tl.sum(row * row, axis=0) / H + eps)
        y = row * inv * tl.load(norm_ptr + cols).to(tl.float32)
        tl.store(xn_ptr + r * H + cols, y.to(xn_ptr.dtype.element_ty))


@triton.jit
def _layers_kernel(xn_ptr, res_ptr, qkv_ptr, xn2_ptr, h_ptr, part_ptr, w_qkv, w_o, w_gu, w_d, n1_ptr, n2_ptr,
                   sync_ptr, eps, phase_start, phase_end, M: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
                   HQ: tl.constexpr, INTER: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr,
                   S_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, S_D: tl.constexpr,
                   BK: tl.constexpr, SYNC: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for phase in range(phase_start, phase_end):
        layer = tl.cast(phase // 6, tl.int64)
        kind = phase % 6
        if kind == 0:  # qkv
            for item in range(pid, W // BN_QKV, P):
                acc = _tile(xn_ptr, H, w_qkv + layer * W * H, H, 0, H, item * BN_QKV, M, BN_QKV, BK)
                cols = item * BN_QKV + tl.arange(0, BN_QKV)
                tl.store(qkv_ptr + tl.arange(0, M)[:, None] * W + cols[None, :], acc.to(qkv_ptr.dtype.element_ty))
        elif kind == 1:  # o (its input: the first HQ columns of qkv)
            _split_k_phase(qkv_ptr, W, w_o + layer * H * HQ, HQ, part_ptr, pid, P, M, H, BN_O, S_O, BK)
        elif kind == 2:
            _norm_rows(part_ptr, res_ptr, n1_ptr + layer * H, xn2_ptr, pid, P, eps, S_O, M, H)
        elif kind == 3:  # gate/up with SwiGLU
            for item in range(pid, INTER // BN_GU, P):
                h = _swiglu_tile(xn2_ptr, w_gu + layer * 2 * INTER * H, H, INTER, item * BN_GU, M, BN_GU, BK)
                cols = item * BN_GU + tl.arange(0, BN_GU)
                tl.store(h_ptr + tl.arange(0, M)[:, None] * INTER + cols[None, :], h.to(h_ptr.dtype.element_ty))
        elif kind == 4:  # down
            _split_k_phase(h_ptr, INTER, w_d + layer * H * INTER, INTER, part_ptr, pid, P, M, H, BN_D, S_D, BK)
        else:
            _norm_rows(part_ptr, res_ptr, n2_ptr + layer * H, xn_ptr, pid, P, eps, S_D, M, H)
        if SYNC:  # noqa: SIM102 (a constexpr test apart from the runtime one)
            if phase + 1 < phase_end:
                _barrier(sync_ptr, (phase + 1 - phase_start) * P)
    if SYNC:  # the last program out leaves the counters at zero for the next launch
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


class Layers:
    """L layers of random weights (bf16) at the given shapes, and the buffers both ways use."""

    def __init__(self, M, H, heads, kv_heads, D, inter, L, device, dtype=torch.bfloat16):
        g = torch.Generator(device="cpu").manual_seed(0)
        rand = lambda *s: (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(device, dtype)
        self.M, self.H, self.HQ, self.inter, self.L = M, H, heads * D, inter, L
        self.W = (heads + 2 * kv_heads) * D
        self.w_qkv, self.w_o = rand(L, self.W, H), rand(L, H, self.HQ)
        self.w_gu, self.w_d = rand(L, 2 * inter, H), rand(L, H, inter)
        self.n1 = (1 + 0.1 * torch.randn(L, H, generator=g)).to(device, dtype)
        self.n2 = (1 + 0.1 * torch.randn(L, H, generator=g)).to(device, dtype)
        self.x0 = torch.randn(M, H, generator=g).to(device, torch.float32)
        self.eps = 1e-6
        self.ones = torch.ones(H, device=device, dtype=dtype)  # (the first norm's weight)

    def unfused(self, res):
        xn, res = norm.add_rmsnorm(res, None, self.ones, self.eps, self.w_qkv.dtype)
        for layer in range(self.L):
            qkv = torch.nn.functional.linear(xn, self.w_qkv[layer])
            o = torch.nn.functional.linear(qkv[:, :self.HQ], self.w_o[layer])
            xn2, res = norm.add_rmsnorm(o, res, self.n1[layer], self.eps, xn.dtype)
            h = activation.silu_mul(torch.nn.functional.linear(xn2, self.w_gu[layer]))
            xn, res = norm.add_rmsnorm(torch.nn.functional.linear(h, self.w_d[layer]), res, self.n2[layer],
                                          self.eps, xn.dtype)
        return xn, res


def persistent(lay: Layers, xn, res, config, programs, bufs, bk=64, warps=4):
    bn_qkv, bn_o, s_o, bn_gu, bn_d, s_d = config
    qkv, xn2, h, part, sync = bufs
    args = (xn, res, qkv, xn2, h, part, lay.w_qkv, lay.w_o, lay.w_gu, lay.w_d, lay.n1, lay.n2, sync, lay.eps)
    consts = dict(M=lay.M, H=lay.H, W=lay.W, HQ=lay.HQ, INTER=lay.inter, BN_QKV=bn_qkv, BN_O=bn_o, S_O=s_o,
                  BN_GU=bn_gu, BN_D=bn_d, S_D=s_d, BK=bk, num_warps=warps)
    phases = 6 * lay.L
    if res.is_cuda:
        _layers_kernel[(programs,)](*args, 0, phases, SYNC=True, **consts)
    else:
        for phase in range(phases):
            _layers_kernel[(programs,)](*args, phase, phase + 1, SYNC=False, **consts)


def buffers(lay: Layers, config, device):
    s = max(config[2], config[5])
    return (torch.empty(lay.M, lay.W, dtype=lay.w_qkv.dtype, device=device),
            torch.empty(lay.M, lay.H, dtype=lay.w_qkv.dtype, device=device),
            torch.empty(lay.M, lay.inter, dtype=lay.w_qkv.dtype, device=device),
            torch.empty(s, lay.M, lay.H, dtype=torch.float32, device=device),
            torch.zeros(3, dtype=torch.int32, device=device))


def graph_ms(fn, replays=50):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--configs", default="64,32,4,32,32,4;32,32,4,32,32,4;32,32,2,16,32,4;64,64,4,32,64,4")
    parser.add_argument("--programs", default="132", help="comma-separated programs per launch to try")
    parser.add_argument("--bk", default="64", help="comma-separated K tiles to try")
    parser.add_argument("--warps", type=int, default=4)
    args = parser.parse_args()
    cpu = not torch.cuda.is_available()
    device = "cpu" if cpu else "cuda"
    if cpu:  # tiny shapes: the arithmetic only
        lay = Layers(16, 64, 4, 2, 16, 96, 2, device, torch.float32)
        configs, programs_list = [(16, 16, 2, 16, 16, 2)], [3]
    else:
        lay = Layers(args.rows, 1024, 16, 8, 128, 3072, args.layers, device)
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
        programs_list = [int(p) for p in args.programs.split(",")]
    ref_xn, ref_res = lay.unfused(lay.x0.clone())
    rows = []
    if not cpu:
        res = lay.x0.clone()
        rows.append({"way": "unfused (cuBLAS + add_rmsnorm + silu_mul)", "ms": graph_ms(lambda: lay.unfused(res))})
        xn, res2 = torch.empty_like(ref_xn), res.clone()
        rows.append({"way": "the persistent run's two resetting copies alone",
                     "ms": graph_ms(lambda: (xn.copy_(ref_xn), res2.copy_(lay.x0)))})
        for row in rows:
            print(json.dumps(row), flush=True)
    xn0, _ = norm.add_rmsnorm(lay.x0, None, lay.ones, lay.eps, lay.w_qkv.dtype)  # (the persistent way's input)
    for config, bk in [(c, 16 if cpu else int(b)) for c in configs for b in args.bk.split(",")]:
        for programs in programs_list:
            bufs = buffers(lay, config, device)
            xn, res = xn0.clone(), lay.x0.clone()
            persistent(lay, xn, res, config, programs, bufs, bk, args.warps)
            err = ((res - ref_res).abs().max() / ref_res.abs().max()).item()
            row = {"way": "persistent", "config": config, "bk": bk, "warps": args.warps, "programs": programs,
                   "res_rel_err": round(err, 5)}
            if not cpu:
                assert bufs[4][2].item() == 0, "a barrier timed out"

                def run(xn=xn, xn0=xn0, res=res, config=config, programs=programs, bufs=bufs, bk=bk):
                    xn.copy_(xn0)
                    res.copy_(lay.x0)
                    persistent(lay, xn, res, config, programs, bufs, bk, args.warps)
                row["ms"] = graph_ms(run)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "on the CPU run with TRITON_INTERPRET=1"
        backend.INTERPRET_ON_CPU = True
    main()

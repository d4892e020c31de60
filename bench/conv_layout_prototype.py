"""The prototype behind the vocoder's context-in-front layout (docs/perf-notes.md entry 24): the k = 7 causal
convolution with each stream's kept context stored in front of its new steps ([B, L + T, C]) read through TMA
tensor descriptors, against `causal_conv`. The prototype's other variant, plain pointer loads with no time
masks, became `causal_conv` itself in commit 7324cf2 (measured then 1.6-2.5x faster than the kernel of commit
5bdca69, which read the context from a separate state with a second masked load); the TMA variant was no
faster. Kernel without bias or activation; times per call of 20 eager calls (fine for these 50-120 us
kernels; shorter ones need CUDA-graph timing as in bench/codec_kernels.py). GPU machine only.

usage: python bench/conv_layout_prototype.py
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from q3tts.kernels import codec as codec_kernels


@triton.jit
def conv_tma(x_ptr, w_ptr, out_ptr, B, T, LT, C_IN, C_OUT, DIL, KS: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr):
    tiles_t = tl.cdiv(T, BM)
    b = tl.program_id(0) // tiles_t
    t0 = (tl.program_id(0) % tiles_t) * BM
    n0 = tl.program_id(1) * BN
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[B, LT, C_IN], strides=[LT * C_IN, C_IN, 1],
                                       block_shape=[1, BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[KS * C_IN, C_OUT], strides=[C_OUT, 1], block_shape=[BK, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_k = tl.cdiv(C_IN, BK)
    for it in range(KS * n_k):
        j = it // n_k
        k0 = (it % n_k) * BK
        a = x_desc.load([b, t0 + j * DIL, k0]).reshape(BM, BK)
        w = w_desc.load([j * C_IN + k0, n0])
        acc = tl.dot(a, w, acc)
    t = t0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    offs = (b * T + t).to(tl.int64)[:, None] * C_OUT + cols[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=(t < T)[:, None] & (cols < C_OUT)[None, :])


def time_ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


CFGS = [(bm, bn, bk, w, s) for bm, bn, bk, (w, s) in
        itertools.product((64, 128), (64, 128), (32, 64), ((4, 3), (8, 4)))]


def main() -> None:
    # device-side TMA descriptors need scratch memory
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    Bs = 64
    for name, T, C_in, C_out, d in (("96", 1920, 96, 96, 9), ("192", 640, 192, 192, 9), ("384", 160, 384, 384, 9),
                                    ("768", 32, 768, 768, 9)):
        L = 6 * d
        k = 7
        dt = torch.bfloat16
        xp = torch.randn(Bs, L + T, C_in, device="cuda", dtype=dt)
        state = xp[:, :L].contiguous()
        w = torch.randn(k, C_in, C_out, device="cuda", dtype=dt) * 0.02
        bias = torch.zeros(C_out, device="cuda", dtype=dt)
        out = torch.empty(Bs, T, C_out, device="cuda", dtype=dt)
        flops = 2 * Bs * T * k * C_in * C_out
        cur = time_ms(functools.partial(codec_kernels.causal_conv, xp, state, w, bias, d, keep_out=True))
        ref, _ = codec_kernels.causal_conv(xp, xp[:, :L].clone(), w, bias, d, keep_out=True)
        res = {}
        for cfg in CFGS:
            BM, BN, BK, nw, ns = cfg
            if BN > 2 * C_out or C_in % BK:  # (the prototype does not mask a partial channel block)
                continue
            grid = (Bs * triton.cdiv(T, BM), triton.cdiv(C_out, BN))
            fn = functools.partial(conv_tma[grid], xp, w, out, Bs, T, L + T, C_in, C_out, d, KS=k, BM=BM, BN=BN,
                                   BK=BK, num_warps=nw, num_stages=ns)
            try:
                out.fill_(0)
                fn()
                e = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
                if e > 2e-2:
                    print(f"  tma {cfg}: WRONG err {e:.2e}")
                    continue
                res[cfg] = time_ms(fn)
            except Exception as ex:  # noqa: BLE001
                print(f"  tma {cfg}: {type(ex).__name__} {str(ex)[:80]}")
        line = f"{name}: causal_conv {cur * 1e3:.1f} us ({flops / cur / 1e9:.0f} TF/s)"
        if res:
            best = min(res, key=res.get)
            line += f"; tma best {best} {res[best] * 1e3:.1f} us ({flops / res[best] / 1e9:.0f} TF/s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()

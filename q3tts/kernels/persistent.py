"""The rest of a decoder layer after its attention, at 64 or 128 rows, as one launch on Hopper (Gluon): the o product,
add + RMSNorm, gate/up with SwiGLU, the down product, add + RMSNorm, and the next layer's qkv product
(docs/perf-notes.md, entries 79-82, 92-93).

At 64 rows a matrix product of these shapes costs cuBLAS ~6-20 us, most of it fixed cost (entries 74-75); this
kernel runs the layer's products and norms in one cooperative launch of one program per SM, with grid barriers
between the phases. Each program walks one stream of its weight tiles (its items of each phase: pid, pid + P, ...)
over all phases through a ring of shared-memory slots filled by TMA ahead of the products that read them, so the
next phase's weights are on their way while the program finishes its phase and waits at the barrier; an item's
input (its [rows, K] activations, bf16) comes by TMA through a second ring, asked for right after the barrier; the
products run on the tensor cores (warpgroup MMA). The o and down products split K into fp32 partial sums, which
the norm phases add to the residual stream in order (deterministic).
"""

from __future__ import annotations

import torch

from . import backend

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # (no Triton, or one without Gluon)
    gluon = None

ENABLED = True  # (False: the decoder keeps its kernels per step; for A/B measurements and tests)
# Programmatic dependent launch (backend.PDL) between each launch and the decode attention on either side of it: a
# launch's programs ask for their first weight tiles before they wait for the attention's output, and the next
# attention is launched while this one runs (docs/perf-notes.md, entry 93).
PDL = True
ROWS = (64, 128)  # the batches the kernel takes: a warpgroup's MMA tile, or two
# Where it beats the kernels per step (docs/perf-notes.md, entries 92, 95): decode steps of 64 rows, and of 128 rows
# for the decoders 1,024 wide (both code predictors, the 0.6B talker; with the 1.7B talker's shapes they lost: its
# gate/up items, 192, on 132 programs), by hidden size; the code predictor's first pass (its rows' positions 0 and 1)
# of 64 and 128 tokens.
DECODE_ROWS, FIRST_PASS_ROWS = {1024: (64, 128), 2048: (64,)}, (64, 128)
HEAD_ROWS = (64,)  # the code predictor's decode steps with its head as their last launch's last phase (entry 98)
BN, BK = 32, 256  # weight tiles [BN, BK], input chunks [rows, BK] (entry 80)
STAGES, INPUT_BYTES = 6, 128 * 1024  # weight tiles asked for ahead (96 KB of shared memory), and input chunks: 4 of
# 64 rows, 2 of 128
SHARED_BYTES = 227 * 1024  # a Hopper program's shared memory


def applies(x: torch.Tensor, weight_dtype: torch.dtype, hidden: int, q_width: int, qkv_width: int,
            inter: int, first_pass: bool = False) -> bool:
    """Whether a decode call (`first_pass`: the code predictor's first pass) over x [N, hidden] of a decoder with
    these shapes runs on this kernel: N in DECODE_ROWS[hidden] (FIRST_PASS_ROWS), bf16 weights, a Hopper GPU,
    shapes that tile (both sizes' code predictors and talkers)."""
    rows = FIRST_PASS_ROWS if first_pass else DECODE_ROWS.get(hidden, ())
    if (not ENABLED or gluon is None or x.device.type != "cuda" or x.shape[0] not in rows
            or weight_dtype != torch.bfloat16):
        return False
    props = torch.cuda.get_device_properties(x.device)
    s_o, s_d = (_split(hidden, k, props.multi_processor_count) for k in (q_width, inter))
    tiles = (hidden % 128, hidden % BK, (q_width // s_o) % BK, (inter // s_d) % BK, qkv_width % BN, inter % BN)
    return (props.major, props.minor) == (9, 0) and not any(tiles) and shared_bytes(x.shape[0]) <= SHARED_BYTES


def _split(hidden: int, k: int, programs: int) -> int:
    """How many ranges the o and down products split K over: enough items for the programs, K chunks whole."""
    s = 1
    while 2 * s * (hidden // BN) <= programs and k % (2 * s * BK) == 0:
        s *= 2
    return s


def _input_stages(rows: int) -> int:
    return INPUT_BYTES // (2 * rows * BK)


def shared_bytes(rows: int) -> int:
    """The kernel's shared memory at `rows` rows: the rings of weight tiles and input chunks, their barriers, 1 KB
    of alignment."""
    return 2 * STAGES * BN * BK + INPUT_BYTES + 8 * (STAGES + _input_stages(rows)) + 1024


class LayerTail:
    """The kernel's launches for one decoder, and the barrier counter they share: sync[0] counts every arrival at a
    barrier since it was made (each launch adds a multiple of its programs, so nothing resets it; int64), sync[1] is
    raised if a barrier gave up waiting, which the cooperative launch, every program resident, rules out."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sync = torch.zeros(2, dtype=torch.int64, device=device)  # arrivals, error flag
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count

    def __call__(self, attended: torch.Tensor, res_in: torch.Tensor, res: torch.Tensor, w, next_w,
                 next_norm: torch.Tensor, eps: float, times: torch.Tensor | None = None,
                 head: torch.Tensor | None = None) -> torch.Tensor:
        """attended [M, Hq D] (the layer's attention output; M one of ROWS), res_in [M, H] fp32 (the residual
        stream before the layer's o product; may be res) -> res (written, fp32) and the next layer's qkv [M, W]
        (next_w given), or the stream normed by next_norm [M, H] (the decoder's output), or with `head` [V, H]
        (no next layer) that output's logits [M, V] in fp32, the launch's last product. w, next_w:
        FusedLayerWeights."""
        pdl = backend.pdl_flags(res, PDL)["PDL"]
        args, consts, out = arguments(attended, res_in, res, w, next_w, next_norm, eps, self.sync, self.programs,
                                      times, pdl, head)
        tail_kernel[(self.programs,)](*args, **consts, num_warps=4, launch_cooperative_grid=True, launch_pdl=pdl)
        return out


def arguments(attended, res_in, res, w, next_w, next_norm, eps, sync, programs, times=None, pdl=False, head=None):
    """The kernel's arguments and constants, and the tensor it returns (its buffers allocated here). times:
    [programs, 6, 2] int64 for each program's clock at each phase's start and end (bench/profilers/layer_tail.py);
    pdl: the launch is a programmatic dependent one (PDL); head: the last product's weight instead of the next layer's
    qkv (its output in fp32)."""
    if head is not None and next_w is not None:
        raise ValueError("the launch's last product is the next layer's qkv or the head, not both")
    M, H = res_in.shape
    if STAGES < 4 or _input_stages(M) < 1:  # (gate/up reads two tiles a chunk while the last chunk's two are in use)
        raise ValueError(f"the rings need >= 4 weight slots and >= 1 input slot, not {STAGES} and {_input_stages(M)}")
    bf, inter, hq = attended.dtype, w.down.shape[1], attended.shape[1]
    s_o, s_d = _split(H, hq, programs), _split(H, inter, programs)
    xn2 = torch.empty(M, H, dtype=bf, device=res.device)
    h = torch.empty(M, inter, dtype=bf, device=res.device)
    xn = torch.empty(M, H, dtype=bf, device=res.device)
    part = torch.empty(max(s_o, s_d), M, H, dtype=torch.float32, device=res.device)
    last = next_w.qkv if next_w is not None else head  # the product after the last norm, if any
    qkv_w = w.qkv if last is None else last  # (without one: a stand-in, not read)
    qkv = xn if last is None else torch.empty(M, last.shape[0], dtype=bf if head is None else torch.float32,
                                              device=res.device)
    weights = [_descriptor(t, [BN, BK]) for t in (w.o, w.gate_up, w.down, qkv_w)]
    inputs = [_descriptor(t, [M, BK]) for t in (attended, xn2, h, xn)]
    args = (*weights, *inputs, res_in, res, xn2, h, xn, qkv, part, w.post_norm, next_norm, sync,
            times if times is not None else sync, eps)
    consts = dict(M=M, H=H, HQ=hq, W=qkv_w.shape[0], INTER=inter, BN=BN, BK=BK, S_O=s_o, S_D=s_d, NS=STAGES,
                  XS=_input_stages(M), NEXT=last is not None, TIMING=times is not None,
                  PDL=pdl)
    return args, consts, qkv


def compile_for_hopper(fn, args, consts: dict, num_warps: int = 4):
    """Compiles a Gluon kernel for sm_90 on any machine (tensors on any device stand in for its arguments'
    types): the check that runs without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    signature, constexprs = {}, {}
    values = dict(zip(fn.arg_names, args)) | consts | {"num_warps": num_warps}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr or name == "num_warps":
            signature[name], constexprs[(i,)] = "constexpr", values[name]
        else:
            signature[name] = mangle_type(values[name])
    return triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def _descriptor(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                            gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


if gluon is not None:
    MAX_SPINS = gl.constexpr(1 << 22)  # a barrier gives up (raising the error flag) instead of hanging the GPU

    @gluon.jit
    def _proxy_fence():
        """Orders this thread's ordinary global accesses with the TMA's (the async proxy) on global memory."""
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _after_predecessor():
        """Under PDL: waits until the kernel before has finished and its writes are visible, then lets the kernel
        after be launched (its programs wait likewise before they read what this one writes)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _stamp(times_ptr, pid, phase, end, TIMING: gl.constexpr):
        """TIMING: this SM's clock at a phase's start (end 0) or end (1), for bench/profilers/layer_tail.py."""
        if TIMING:
            clock = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False,
                                              pack=1)
            gl.store(times_ptr + (pid * 6 + phase) * 2 + end, clock)

    @gluon.jit
    def grid_barrier(sync_ptr, target, P):
        """Every program arrives (release) and waits until the count reaches `target` (acquire); sync_ptr[1] is
        raised if the wait gave up. Target 0: the launch's first barrier, whose target follows from the count before
        this arrival (every launch before has ended, each adding a multiple of P; of this launch's, at most P - 1
        came before). Returns the target. The last to arrive knows it from its own arrival and does not poll."""
        gl.thread_barrier()
        _proxy_fence()
        before = gl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
        if target == 0:
            target = before - before % P + P
        spins = 0
        if before + 1 < target:
            while (gl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target) & (spins < MAX_SPINS):
                spins += 1
        if spins >= MAX_SPINS:
            gl.store(sync_ptr + 1, 1)
        _proxy_fence()
        gl.thread_barrier()
        return target

    @gluon.jit
    def norm_rows(part_ptr, res_in_ptr, res_ptr, norm, xn_ptr, pid, P, eps, S: gl.constexpr, M: gl.constexpr,
                  H: gl.constexpr, num_warps: gl.constexpr):
        """res = res_in + the S partial sums, in order; xn = rmsnorm(res) * norm (fp32, in the kernel's norm_layout),
        one row per program."""
        cols = gl.arange(0, H, layout=norm.type.layout)
        for r in range(pid, M, P):
            row = gl.load(res_in_ptr + r * H + cols).to(gl.float32)  # (res_in: fp32, or bf16 input rows)
            for s in range(S):
                row += gl.load(part_ptr + (s * M + r) * H + cols)
            gl.store(res_ptr + r * H + cols, row)
            inv = gl.rsqrt(gl.sum(row * row, axis=0) / H + eps)
            gl.store(xn_ptr + r * H + cols, (row * inv * norm).to(xn_ptr.dtype.element_ty))

    @gluon.jit
    def _items(j, H: gl.constexpr, W: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr, S_O: gl.constexpr,
               S_D: gl.constexpr):
        """Items of product j (0 o, 1 gate/up, 2 down, 3 the next qkv)."""
        return ((j == 0) * ((H // BN) * S_O) + (j == 1) * (INTER // BN) + (j == 2) * ((H // BN) * S_D)
                + (j == 3) * (W // BN))

    @gluon.jit
    def _tiles(j, H: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr, BK: gl.constexpr, S_O: gl.constexpr,
               S_D: gl.constexpr):
        """Weight tiles of one item of product j (gate/up: a gate tile and an up tile per K chunk)."""
        return ((j == 0) * (HQ // S_O // BK) + (j == 1) * (2 * (H // BK)) + (j == 2) * (INTER // S_D // BK)
                + (j == 3) * (H // BK))

    @gluon.jit
    def _next_product(f, pid, NJ: gl.constexpr, H: gl.constexpr, W: gl.constexpr, INTER: gl.constexpr,
                      BN: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr):
        """The next product after f with an item for this program; NJ when none is left."""
        f += 1
        while (f < NJ) & (pid >= _items(f, H, W, INTER, BN, S_O, S_D)):
            f += 1
        return f

    @gluon.jit
    def _issue(f, it, pc, ti, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, NJ: gl.constexpr, NS: gl.constexpr,
               H: gl.constexpr, W: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr):
        """Asks for the stream's next weight tile (product f, item it, its tile pc) into ring slot ti % NS;
        advances the cursor over the program's items (pid, pid + P, ...) and products."""
        if f < NJ:
            slot = ti % NS
            bar = bars.index(slot)
            dst = ring.index(slot)
            mbarrier.expect(bar, BN * BK * 2)
            nb = it % (H // BN)
            if f == 0:
                tma.async_copy_global_to_shared(d_o, [nb * BN, (it // (H // BN)) * (HQ // S_O) + pc * BK], bar, dst)
            elif f == 1:
                tma.async_copy_global_to_shared(d_gu, [(pc % 2) * INTER + it * BN, (pc // 2) * BK], bar, dst)
            elif f == 2:
                tma.async_copy_global_to_shared(d_down, [nb * BN, (it // (H // BN)) * (INTER // S_D) + pc * BK], bar,
                                                dst)
            else:
                tma.async_copy_global_to_shared(d_qkv, [it * BN, pc * BK], bar, dst)
            ti += 1
            pc += 1
            if pc == _tiles(f, H, HQ, INTER, BK, S_O, S_D):
                pc = 0
                it += P
                if it >= _items(f, H, W, INTER, BN, S_O, S_D):
                    it = pid
                    f = _next_product(f, pid, NJ, H, W, INTER, BN, S_O, S_D)
        return f, it, pc, ti

    @gluon.jit
    def _issue_input(x_desc, k, xi, x_smem, x_bars, M: gl.constexpr, BK: gl.constexpr, XS: gl.constexpr):
        """Asks for input chunk x[:, k:k + BK] into input slot xi % XS."""
        mbarrier.expect(x_bars.index(xi % XS), M * BK * 2)
        tma.async_copy_global_to_shared(x_desc, [0, k], x_bars.index(xi % XS), x_smem.index(xi % XS))
        return xi + 1

    @gluon.jit
    def _product(x_desc, k0, n, acc, xi, xc, x_smem, x_bars, f, it, pc, ti, tc, pid, P, ring, bars, d_o, d_gu,
                 d_down, d_qkv, TWO: gl.constexpr, NJ: gl.constexpr, NS: gl.constexpr, XS: gl.constexpr,
                 M: gl.constexpr, H: gl.constexpr, W: gl.constexpr, HQ: gl.constexpr, INTER: gl.constexpr,
                 BN: gl.constexpr, BK: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr):
        """acc += x[:, k0:k0 + n BK] @ (the weight ring's next tiles)^T, the input through its own ring (XS chunks
        asked for ahead), one MMA kept in flight; each slot refilled once the MMA that read it is done. TWO (gate
        and up): two tiles per chunk, two accumulators (acc a tuple) -- returned as computed."""
        nx = gl.minimum(n, XS)
        for c in range(nx):
            xi = _issue_input(x_desc, k0 + c * BK, xi, x_smem, x_bars, M, BK, XS)
        for c in range(n):
            mbarrier.wait(x_bars.index(xc % XS), (xc // XS) & 1)
            x = x_smem.index(xc % XS)
            xc += 1
            mbarrier.wait(bars.index(tc % NS), (tc // NS) & 1)
            if TWO:
                g, u = acc
                g = warpgroup_mma(x, ring.index(tc % NS).permute((1, 0)), g, is_async=True)
                mbarrier.wait(bars.index((tc + 1) % NS), ((tc + 1) // NS) & 1)
                u = warpgroup_mma(x, ring.index((tc + 1) % NS).permute((1, 0)), u, is_async=True)
                tc += 2
                acc = warpgroup_mma_wait(num_outstanding=2, deps=(g, u))
            else:
                acc = warpgroup_mma(x, ring.index(tc % NS).permute((1, 0)), acc, is_async=True)
                tc += 1
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if c >= 1:  # the previous chunk's products are done: its slots take what comes next
                if nx < n:
                    xi = _issue_input(x_desc, k0 + nx * BK, xi, x_smem, x_bars, M, BK, XS)
                    nx += 1
                for _tile in gl.static_range(2 if TWO else 1):
                    f, it, pc, ti = _issue(f, it, pc, ti, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, NJ, NS, H,
                                           W, HQ, INTER, BN, BK, S_O, S_D)
        if TWO:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=acc)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        for _tile in gl.static_range(2 if TWO else 1):
            f, it, pc, ti = _issue(f, it, pc, ti, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, NJ, NS, H, W, HQ,
                                   INTER, BN, BK, S_O, S_D)
        return acc, xi, xc, f, it, pc, ti, tc

    @gluon.jit
    def tail_kernel(d_o, d_gu, d_down, d_qkv, x_att, x_xn2, x_h, x_xn, res_in_ptr, res_ptr, xn2_ptr, h_ptr, xn_ptr,
                    qkv_ptr, part_ptr, post_norm_ptr, next_norm_ptr, sync_ptr, times_ptr, eps, M: gl.constexpr,
                    H: gl.constexpr, HQ: gl.constexpr, W: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr,
                    BK: gl.constexpr, S_O: gl.constexpr, S_D: gl.constexpr, NS: gl.constexpr, XS: gl.constexpr,
                    NEXT: gl.constexpr, TIMING: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        NJ: gl.constexpr = 4 if NEXT else 3  # products: o, gate/up, down (, the next qkv)
        ring = gl.allocate_shared_memory(gl.bfloat16, [NS, BN, BK], d_o.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [XS, M, BK], x_att.layout)
        x_bars = gl.allocate_shared_memory(gl.int64, [XS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NS):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(XS):
            mbarrier.init(x_bars.index(i), count=1)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        rows = gl.arange(0, M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))

        # the weight stream's cursor (product f, item it, tile pc, tiles issued ti): its first NS tiles asked for
        f = _next_product(-1, pid, NJ, H, W, INTER, BN, S_O, S_D)
        it = pid
        pc = 0
        ti = 0
        for _first in range(NS):
            f, it, pc, ti = _issue(f, it, pc, ti, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, NJ, NS, H, W, HQ,
                                   INTER, BN, BK, S_O, S_D)
        # the norms' weights, read while nothing waits on them (entry 101)
        norm_layout: gl.constexpr = gl.BlockedLayout([H // (32 * num_warps)], [32], [num_warps], [0])
        norm_cols = gl.arange(0, H, layout=norm_layout)
        post_norm = gl.load(post_norm_ptr + norm_cols).to(gl.float32)
        next_norm = gl.load(next_norm_ptr + norm_cols).to(gl.float32)
        if PDL:  # (the weights above depend on nothing before; everything below may)
            _after_predecessor()
        tc = 0  # weight tiles consumed
        xi = 0  # input chunks asked for
        xc = 0  # input chunks consumed

        _stamp(times_ptr, pid, 0, 0, TIMING)
        for item in range(pid, (H // BN) * S_O, P):  # o = attended Wo^T, K split in S_O ranges: fp32 partial sums
            s = item // (H // BN)
            acc = gl.zeros([M, BN], gl.float32, acc_layout)
            acc, xi, xc, f, it, pc, ti, tc = _product(x_att, s * (HQ // S_O), HQ // S_O // BK, acc, xi, xc, x_smem,
                                                      x_bars, f, it, pc, ti, tc, pid, P, ring, bars, d_o, d_gu,
                                                      d_down, d_qkv, False, NJ, NS, XS, M, H, W, HQ, INTER, BN, BK,
                                                      S_O, S_D)
            gl.store(part_ptr + (s * M + rows[:, None]) * H + ((item % (H // BN)) * BN + cols)[None, :], acc)
        _stamp(times_ptr, pid, 0, 1, TIMING)
        base = grid_barrier(sync_ptr, 0, P) - P  # (the arrivals counted before this launch)
        _stamp(times_ptr, pid, 1, 0, TIMING)
        norm_rows(part_ptr, res_in_ptr, res_ptr, post_norm, xn2_ptr, pid, P, eps, S_O, M, H, num_warps)
        _stamp(times_ptr, pid, 1, 1, TIMING)
        grid_barrier(sync_ptr, base + 2 * P, P)
        _stamp(times_ptr, pid, 2, 0, TIMING)

        for item in range(pid, INTER // BN, P):  # h = silu(xn2 Wg^T) * (xn2 Wu^T): gate and up tiles alternate
            g = gl.zeros([M, BN], gl.float32, acc_layout)
            u = gl.zeros([M, BN], gl.float32, acc_layout)
            gu, xi, xc, f, it, pc, ti, tc = _product(x_xn2, 0, H // BK, (g, u), xi, xc, x_smem, x_bars, f, it, pc,
                                                     ti, tc, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, True, NJ,
                                                     NS, XS, M, H, W, HQ, INTER, BN, BK, S_O, S_D)
            g, u = gu
            act = g / (1.0 + gl.exp(-g)) * u
            gl.store(h_ptr + rows[:, None] * INTER + (item * BN + cols)[None, :], act.to(gl.bfloat16))
        _stamp(times_ptr, pid, 2, 1, TIMING)
        grid_barrier(sync_ptr, base + 3 * P, P)
        _stamp(times_ptr, pid, 3, 0, TIMING)

        for item in range(pid, (H // BN) * S_D, P):  # down, K split in S_D ranges
            s = item // (H // BN)
            acc = gl.zeros([M, BN], gl.float32, acc_layout)
            acc, xi, xc, f, it, pc, ti, tc = _product(x_h, s * (INTER // S_D), INTER // S_D // BK, acc, xi, xc,
                                                      x_smem, x_bars, f, it, pc, ti, tc, pid, P, ring, bars, d_o,
                                                      d_gu, d_down, d_qkv, False, NJ, NS, XS, M, H, W, HQ, INTER, BN,
                                                      BK, S_O, S_D)
            gl.store(part_ptr + (s * M + rows[:, None]) * H + ((item % (H // BN)) * BN + cols)[None, :], acc)
        _stamp(times_ptr, pid, 3, 1, TIMING)
        grid_barrier(sync_ptr, base + 4 * P, P)
        _stamp(times_ptr, pid, 4, 0, TIMING)
        norm_rows(part_ptr, res_ptr, res_ptr, next_norm, xn_ptr, pid, P, eps, S_D, M, H, num_warps)
        _stamp(times_ptr, pid, 4, 1, TIMING)

        if NEXT:  # the next layer's qkv = xn Wqkv^T (or the head's logits, in fp32)
            grid_barrier(sync_ptr, base + 5 * P, P)
            _stamp(times_ptr, pid, 5, 0, TIMING)
            for item in range(pid, W // BN, P):
                acc = gl.zeros([M, BN], gl.float32, acc_layout)
                acc, xi, xc, f, it, pc, ti, tc = _product(x_xn, 0, H // BK, acc, xi, xc, x_smem, x_bars, f, it, pc,
                                                          ti, tc, pid, P, ring, bars, d_o, d_gu, d_down, d_qkv, False,
                                                          NJ, NS, XS, M, H, W, HQ, INTER, BN, BK, S_O, S_D)
                gl.store(qkv_ptr + rows[:, None] * W + (item * BN + cols)[None, :], acc.to(qkv_ptr.dtype.element_ty))
            _stamp(times_ptr, pid, 5, 1, TIMING)

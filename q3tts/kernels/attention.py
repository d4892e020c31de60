"""Attention kernels of the talker and the code predictor (Triton), each with a PyTorch twin: q/k RMSNorm + RoPE +
KV-cache store, paged causal attention (prefill), the fused decode attention and the rows' first two positions
in pairs.

KV caches are paged: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; row r's position p
lives in block `block_table[r, p // block_size]`, slot `p % block_size`.
"""

from __future__ import annotations

import torch

from .backend import pdl_flags, triton, use_triton
from .norm import rmsnorm_ref

if triton is not None:
    import triton.language as tl

# ---- q/k RMSNorm + RoPE + KV-cache store ---------------------------------------------------------------------

def qk_norm_rope_store(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                       inv_freq: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                       block_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       num_heads: int) -> torch.Tensor:
    """qkv: [N, (Hq + 2 Hkv) * D] (q heads, k heads, v heads). Normalises q and k per head, rotates them
    (rotate-half RoPE at `positions`), stores k and v in the paged cache, returns q: [N, Hq, D] fp32."""
    N = qkv.shape[0]
    _, block_size, num_kv, D = k_cache.shape
    if not use_triton(qkv):
        return qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache,
                                      v_cache, num_heads)
    q = torch.empty(N, num_heads, D, dtype=torch.float32, device=qkv.device)
    _qk_norm_rope_store_kernel[(N, num_heads + num_kv)](
        qkv, q_norm, k_norm, inv_freq, rows, positions, block_table, k_cache, v_cache, q, eps,
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV=num_kv, D=D, BLOCK_SIZE=block_size, num_warps=1)
    return q


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x: [N, H, D] fp32 -> rotated (rotate-half layout), angles in fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None]  # [N, D/2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                           num_heads):
    """The PyTorch twin of the qk-norm, RoPE and KV store (returns q; writes k and v into the paged cache), run where
    the kernel is not; public for the kernel tests."""
    N = qkv.shape[0]
    _, block_size, num_kv, D = k_cache.shape
    parts = qkv.float().view(N, num_heads + 2 * num_kv, D)
    q = _rotate(rmsnorm_ref(parts[:, :num_heads], q_norm, eps), positions, inv_freq)
    k = _rotate(rmsnorm_ref(parts[:, num_heads:num_heads + num_kv], k_norm, eps), positions, inv_freq)
    blocks = block_table[rows.long(), positions.long() // block_size].long()
    slots = positions.long() % block_size
    k_cache[blocks, slots] = k.to(k_cache.dtype)
    v_cache[blocks, slots] = parts[:, num_heads + num_kv:].to(v_cache.dtype)
    return q


if triton is not None:
    @triton.jit
    def _qk_norm_rope_store_kernel(qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr, rows_ptr, pos_ptr, table_ptr, k_ptr,
                                   v_ptr, q_out_ptr, eps, table_stride, cache_s0, cache_s1, cache_s2,
                                   NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr,
                                   BLOCK_SIZE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = tl.arange(0, D // 2)
        width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
        base = qkv_ptr + t * width + h * D
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        is_q = h < NUM_HEADS
        w_ptr = tl.where(is_q, qn_ptr, kn_ptr)
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        x1, x2 = x1 * inv * w1, x2 * inv * w2
        pos = tl.load(pos_ptr + t)
        freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)
        cos, sin = tl.cos(freqs), tl.sin(freqs)
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if is_q:
            out = q_out_ptr + (t * NUM_HEADS + h) * D
            tl.store(out + half, y1)
            tl.store(out + D // 2 + half, y2)
        else:
            kv_head = h - NUM_HEADS
            row = tl.load(rows_ptr + t).to(tl.int64)
            block = tl.load(table_ptr + row * table_stride + pos // BLOCK_SIZE).to(tl.int64)
            offset = block * cache_s0 + (pos % BLOCK_SIZE) * cache_s1 + kv_head * cache_s2
            tl.store(k_ptr + offset + half, y1.to(k_ptr.dtype.element_ty))
            tl.store(k_ptr + offset + D // 2 + half, y2.to(k_ptr.dtype.element_ty))
            v = qkv_ptr + t * width + (NUM_HEADS + NUM_KV + kv_head) * D
            tl.store(v_ptr + offset + half, tl.load(v + half))
            tl.store(v_ptr + offset + D // 2 + half, tl.load(v + D // 2 + half))


# ---- paged causal attention, one query token per program ----------------------------------------------------

def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    rows: torch.Tensor, positions: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q: [N, Hq, D] fp32; token t attends to positions 0..positions[t] of row rows[t]. Returns [N, Hq * D].

    Consecutive tokens of one row at consecutive positions (a prefill's) attend together, ATTENTION_QUERY_ROWS
    query rows (tokens x query heads of a KV head) per program: the row's keys and values are read once for all of
    them instead of once per token (perf-notes 70). Any layout is served (tokens of many rows, one each)."""
    N, Hq, D = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    if not use_triton(q):
        return paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions).to(out_dtype)
    if block_size < 16 or Hq // num_kv > 16:
        raise ValueError("the attention kernel needs block_size >= 16 and <= 16 query heads per KV head")
    out = torch.empty(N, Hq * D, dtype=out_dtype, device=q.device)
    group = triton.next_power_of_2(Hq // num_kv)
    _paged_attention_kernel[(N, num_kv)](
        q, k_cache, v_cache, block_table, rows, positions, out, N, D**-0.5, block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), GROUP=Hq // num_kv, GROUP_P2=group, D=D,
        BLOCK_SIZE=block_size, TOKENS=max(1, ATTENTION_QUERY_ROWS // group), IEEE=k_cache.dtype == torch.float32,
        num_warps=4)
    return out


# Query rows (tokens x query heads of a KV head) per program of paged_attention: 64 is 32 tokens of Qwen3-TTS's
# two query heads per KV head.
ATTENTION_QUERY_ROWS = 64


def paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions):
    """The PyTorch twin of paged decode attention (fp32 out), run where the kernel is not; public for the kernel
    tests."""
    N, Hq, D = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    out = torch.empty(N, Hq, D, dtype=torch.float32, device=q.device)
    for t in range(N):
        n = int(positions[t]) + 1
        p = torch.arange(n, device=q.device)
        blocks = block_table[int(rows[t]), p // block_size].long()
        k = k_cache[blocks, p % block_size].float().repeat_interleave(Hq // num_kv, dim=1)  # [n, Hq, D]
        v = v_cache[blocks, p % block_size].float().repeat_interleave(Hq // num_kv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[t], k) * D**-0.5
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.view(N, Hq * D)


if triton is not None:
    @triton.jit
    def _attend(q, k_ptr, v_ptr, table_ptr, row, pos, kv_head, scale, table_stride, cache_s0, cache_s1, cache_s2,
                D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
        """Softmax attention of q [16, D] (the cache's dtype) over positions 0..pos of `row` for `kv_head`,
        online over the row's blocks; returns [16, D] fp32."""
        m = tl.full([16], float("-inf"), tl.float32)
        denom = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, D], tl.float32)
        m, denom, acc = _attend_span(q, k_ptr, v_ptr, table_ptr, row, 0, pos, pos, kv_head, m, denom, acc, scale,
                                     table_stride, cache_s0, cache_s1, cache_s2, D, BLOCK_SIZE, IEEE)
        return acc / denom[:, None]

    @triton.jit
    def _attend_span(q, k_ptr, v_ptr, table_ptr, row, first, last, limits, kv_head, m, denom, acc, scale,
                     table_stride, cache_s0, cache_s1, cache_s2, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     IEEE: tl.constexpr):
        """Positions first..last of `row` (`first` a block's first) into the online softmax state, block by
        block (see _attend_block); each query row attends up to its limit (`limits`: `last` for all, or [M, 1]
        per row, none beyond `last`)."""
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_SIZE)
        for start in range(first, last + 1, BLOCK_SIZE):
            block = tl.load(table_ptr + row * table_stride + start // BLOCK_SIZE).to(tl.int64)
            offs = block * cache_s0 + n[:, None] * cache_s1 + kv_head * cache_s2 + d[None, :]
            in_block = (start + n) <= last
            k = tl.load(k_ptr + offs, mask=in_block[:, None], other=0.0)  # [N, D]
            v = tl.load(v_ptr + offs, mask=in_block[:, None], other=0.0)
            m, denom, acc = _attend_block(q, k, v, (start + n)[None, :] <= limits, m, denom, acc, scale, IEEE)
        return m, denom, acc

    @triton.jit
    def _attend_block(q, k, v, valid, m, denom, acc, scale, IEEE: tl.constexpr):
        """One block of keys and values [N, D] (`valid` [1 or M, N]: the positions each query row attends) into the
        online softmax state (m, denom [M]; acc [M, D], fp32) of q [M, D]. A block with no valid position leaves
        a row's state as is."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (nothing valid yet: every exp below is 0)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, denom, acc

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, pos_ptr, out_ptr, N, scale, table_stride,
                                cache_s0, cache_s1, cache_s2, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                                D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
                                IEEE: tl.constexpr):
        # One program per (token, kv head); the token leads a run when it starts its row's consecutive positions in
        # the list or a TOKENS-aligned span of them, and its run (itself and the next tokens of its row at the
        # next positions, up to the span's end) attends together: TOKENS x GROUP_P2 query rows (GROUP heads of
        # each token, padded to a power of two), each masked to its own token's positions. The other programs
        # return at once. Every token belongs to exactly one run, whatever the layout.
        t = tl.program_id(0)
        kv_head = tl.program_id(1)
        row = tl.load(rows_ptr + t)
        pos = tl.load(pos_ptr + t)
        prev = tl.maximum(t - 1, 0)
        leads = (t == 0) | (pos % TOKENS == 0) | (tl.load(rows_ptr + prev) != row)
        leads = leads | (tl.load(pos_ptr + prev) != pos - 1)
        if leads:
            M: tl.constexpr = TOKENS * GROUP_P2
            r = tl.arange(0, M)
            i = r // GROUP_P2  # (the run's i-th token)
            head = r % GROUP_P2
            tok = t + i
            in_list = tok < N
            tok_pos = tl.load(pos_ptr + tok, mask=in_list, other=-1)
            tok_row = tl.load(rows_ptr + tok, mask=in_list, other=-1)
            mine = in_list & (tok_row == row) & (tok_pos == pos + i) & (tok_pos // TOKENS == pos // TOKENS)
            query = mine & (head < GROUP)
            d = tl.arange(0, D)
            offs = ((tok.to(tl.int64) * tl.num_programs(1) + kv_head) * GROUP + head)[:, None] * D + d[None, :]
            q = tl.load(q_ptr + offs, mask=query[:, None], other=0.0).to(k_ptr.dtype.element_ty)  # [M, D]
            last = tl.max(tl.where(mine, tok_pos, -1), axis=0)
            m = tl.full([M], float("-inf"), tl.float32)
            denom = tl.zeros([M], tl.float32)
            acc = tl.zeros([M, D], tl.float32)
            m, denom, acc = _attend_span(q, k_ptr, v_ptr, table_ptr, row.to(tl.int64), 0, last, tok_pos[:, None],
                                         kv_head, m, denom, acc, scale, table_stride, cache_s0, cache_s1, cache_s2,
                                         D, BLOCK_SIZE, IEEE)
            out = acc / tl.where(query, denom, 1.0)[:, None]
            tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=query[:, None])


# ---- decode: q/k RMSNorm + RoPE + KV store + attention in one kernel --------------------------------------------

# decode_attention's warps per program: 4 (one row: 2 / 4 / 8 warps took 4.1 / 3.6 / 4.8 us, perf-notes 49), but
# SHORT_CONTEXT_WARPS for more than 64 tokens whose rows hold at most 64 positions (the code predictor's 16: one
# warp took the 192-row frame from 5.75 to 5.53 ms (0.6B) and 6.75 to 6.54 (1.7B), 64 rows unchanged; perf-notes 61)
DECODE_ATTENTION_WARPS = 4
SHORT_CONTEXT_WARPS = 1
# Calls of up to EARLY_MAX_TOKENS tokens, and calls of EARLY_SHORT_TOKENS tokens whose rows hold at most
# EARLY_MAX_POSITIONS positions (the code predictor's 64-row steps, between launches of the layer tail), read the
# first block early (see _decode_attention_kernel's EARLY; perf-notes 56, 76, 97: the code predictor's steps at 64
# rows gain with it, at 16, 32 and 128 lose, as the talker's 64-row steps do).
EARLY_MAX_TOKENS, EARLY_SHORT_TOKENS, EARLY_MAX_POSITIONS = 1, (64,), 64


def decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                     inv_freq: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                     out_dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """`qk_norm_rope_store` then `paged_attention`, in one launch, for decode: every token is the one new token
    of its row (tokens of one row would race: a program reads only the keys it wrote itself). Returns
    [N, Hq * D]. `pdl`: launched with PDL (see PDL above)."""
    N = qkv.shape[0]
    _, block_size, num_kv, D = k_cache.shape
    if not use_triton(qkv):
        return _store_then_attend_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache,
                                      v_cache, num_heads, out_dtype)
    if block_size < 16 or num_heads // num_kv > 16:
        raise ValueError("the attention kernel needs block_size >= 16 and <= 16 query heads per KV head")
    out = torch.empty(N, num_heads * D, dtype=out_dtype, device=qkv.device)
    max_positions = block_table.shape[1] * block_size
    _decode_attention_kernel[(N, num_kv)](
        qkv, q_norm, k_norm, inv_freq, rows, positions, block_table, k_cache, v_cache, out, eps, D**-0.5,
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV=num_kv, GROUP=num_heads // num_kv, D=D, BLOCK_SIZE=block_size,
        IEEE=k_cache.dtype == torch.float32, EARLY=reads_early(N, max_positions),
        num_warps=decode_attention_warps(N, max_positions), **pdl_flags(qkv, pdl))
    return out


def _store_then_attend_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                           num_heads, out_dtype):
    """decode_attention's and pair_attention's twin: the two kernels they fuse, in PyTorch."""
    q = qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                               num_heads)
    return paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions).to(out_dtype)


def reads_early(num_tokens: int, max_positions: int) -> bool:
    """Whether the decode attention kernel reads its KV early (EARLY); public for the kernel tests."""
    return num_tokens <= EARLY_MAX_TOKENS or (num_tokens in EARLY_SHORT_TOKENS and max_positions <= EARLY_MAX_POSITIONS)


def decode_attention_warps(num_tokens: int, max_positions: int) -> int:
    """The decode attention kernel's warps per program; public for the kernel tests."""
    return SHORT_CONTEXT_WARPS if num_tokens > 64 and max_positions <= 64 else DECODE_ATTENTION_WARPS


if triton is not None:
    @triton.jit
    def _norm_rope(x, x_partner, w, w_partner, cos, sin, sign, eps, D: tl.constexpr):
        """RMSNorm over the last axis (D) then rotate-half RoPE; `x_partner` is x at (d + D/2) % D."""
        inv = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
        return x * inv * w * cos + sign * (x_partner * inv * w_partner) * sin

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr, rows_ptr, pos_ptr, table_ptr, k_ptr, v_ptr,
                                 out_ptr, eps, scale, table_stride, cache_s0, cache_s1, cache_s2,
                                 NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr,
                                 D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
                                 EARLY: tl.constexpr, PDL: tl.constexpr):
        # One program per (token, kv head): its key and value normed, rotated and stored, then its GROUP query
        # heads (padded to 16 rows for the tensor cores) normed, rotated and attended over the row's positions.
        # EARLY (one token): the row's first block of keys and values is requested before anything that reads the
        # previous kernel's results (under PDL, while that kernel finishes: the cache's earlier positions were
        # written two kernels or more before), and the token's own position is attended from registers (its key
        # rounded as the cache holds it), so nothing waits on the store. Measured: perf-notes 56 (one token
        # faster, many tokens slower: registers held across the norms) and 62.
        t = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_SIZE)
        pos = tl.load(pos_ptr + t)
        row = tl.load(rows_ptr + t).to(tl.int64)
        if EARLY:
            first = tl.load(table_ptr + row * table_stride).to(tl.int64)
            cached = n < pos
            first_offs = first * cache_s0 + n[:, None] * cache_s1 + kv_head * cache_s2 + d[None, :]
            k_first = tl.load(k_ptr + first_offs, mask=cached[:, None], other=0.0)  # [N, D]
            v_first = tl.load(v_ptr + first_offs, mask=cached[:, None], other=0.0)
        partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % (D // 2))
        cos, sin = tl.cos(freqs), tl.sin(freqs)
        if PDL:  # (see PDL above) everything below reads the previous kernel's results
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

        k_base = qkv_ptr + t * width + (NUM_HEADS + kv_head) * D
        k = _norm_rope(tl.load(k_base + d).to(tl.float32), tl.load(k_base + partner).to(tl.float32),
                       tl.load(kn_ptr + d).to(tl.float32), tl.load(kn_ptr + partner).to(tl.float32), cos, sin, sign,
                       eps, D).to(k_ptr.dtype.element_ty)
        v = tl.load(qkv_ptr + t * width + (NUM_HEADS + NUM_KV + kv_head) * D + d)
        block = tl.load(table_ptr + row * table_stride + pos // BLOCK_SIZE).to(tl.int64)
        slot = block * cache_s0 + (pos % BLOCK_SIZE) * cache_s1 + kv_head * cache_s2
        tl.store(k_ptr + slot + d, k)
        tl.store(v_ptr + slot + d, v)

        g = tl.arange(0, 16)
        in_group = g < GROUP
        q_base = qkv_ptr + t * width + (kv_head * GROUP + g[:, None]) * D
        q = _norm_rope(tl.load(q_base + d[None, :], mask=in_group[:, None], other=0.0).to(tl.float32),
                       tl.load(q_base + partner[None, :], mask=in_group[:, None], other=0.0).to(tl.float32),
                       tl.load(qn_ptr + d).to(tl.float32)[None, :], tl.load(qn_ptr + partner).to(tl.float32)[None, :],
                       cos[None, :], sin[None, :], sign[None, :], eps, D)
        q = q.to(k_ptr.dtype.element_ty)  # [16, D]
        if EARLY:
            m = tl.full([16], float("-inf"), tl.float32)
            denom = tl.zeros([16], tl.float32)
            acc = tl.zeros([16, D], tl.float32)
            m, denom, acc = _attend_block(q, k_first, v_first, cached[None, :], m, denom, acc, scale, IEEE)
            # the row's further blocks before its own position
            m, denom, acc = _attend_span(q, k_ptr, v_ptr, table_ptr, row, BLOCK_SIZE, pos - 1, pos - 1, kv_head, m,
                                         denom, acc, scale, table_stride, cache_s0, cache_s1, cache_s2, D, BLOCK_SIZE,
                                         IEEE)
            # its own position, as a block of one
            s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], axis=1) * scale  # [16]
            m_new = tl.maximum(m, s)
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + p
            if not IEEE:
                p = p.to(v.dtype).to(tl.float32)  # (as the tensor cores take it)
            out = (acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]) / denom[:, None]
        else:
            tl.debug_barrier()  # the key and value stored above are read below by other threads of this program
            out = _attend(q, k_ptr, v_ptr, table_ptr, row, pos, kv_head, scale, table_stride, cache_s0, cache_s1,
                          cache_s2, D, BLOCK_SIZE, IEEE)
        out_offs = (t * NUM_HEADS + kv_head * GROUP + g[:, None]) * D + d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])


# ---- the first two positions of rows, in pairs: q/k norm + RoPE + KV store + attention in one kernel ---------

def pair_attention(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                   inv_freq: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """`qk_norm_rope_store` then `paged_attention`, in one launch, for tokens in pairs that are their row's first
    two positions (tokens 2i and 2i + 1: positions 0 and 1 of one row, nothing before them; the code predictor's
    first pass): one program per (pair, KV head) stores the pair's keys and values and attends to them from its
    registers. Returns [N, Hq * D]. (Measured: docs/perf-notes.md, entry 91.)"""
    N = qkv.shape[0]
    _, block_size, num_kv, D = k_cache.shape
    if not use_triton(qkv):
        return _store_then_attend_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache,
                                      v_cache, num_heads, out_dtype)
    if N % 2 or block_size < 2:
        raise ValueError("pair_attention takes tokens in pairs and cache blocks of at least two positions")
    out = torch.empty(N, num_heads * D, dtype=out_dtype, device=qkv.device)
    group = num_heads // num_kv
    _pair_attention_kernel[(N // 2, num_kv)](
        qkv, q_norm, k_norm, inv_freq, rows, positions, block_table, k_cache, v_cache, out, eps, D**-0.5,
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_HEADS=num_heads,
        NUM_KV=num_kv, GROUP=group, GROUP_P2=triton.next_power_of_2(group), D=D, BLOCK_SIZE=block_size,
        IEEE=k_cache.dtype == torch.float32, num_warps=1)
    return out


if triton is not None:
    @triton.jit
    def _pair_token(qkv_ptr, qn, qn_p, kn, kn_p, inv_freq_ptr, pos_ptr, table_ptr, k_ptr, v_ptr, t, row, kv_head,
                    eps, table_stride, cache_s0, cache_s1, cache_s2, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Token t's key and value for kv_head normed, rotated and stored; returns (its GROUP query heads normed and
        rotated [GROUP_P2, D], its key and value [D], in the cache's dtype)."""
        width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        pos = tl.load(pos_ptr + t)
        freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + d % (D // 2))
        cos, sin = tl.cos(freqs), tl.sin(freqs)
        k_base = qkv_ptr + t * width + (NUM_HEADS + kv_head) * D
        k = _norm_rope(tl.load(k_base + d).to(tl.float32), tl.load(k_base + partner).to(tl.float32), kn, kn_p, cos,
                       sin, sign, eps, D).to(k_ptr.dtype.element_ty)
        v = tl.load(qkv_ptr + t * width + (NUM_HEADS + NUM_KV + kv_head) * D + d).to(v_ptr.dtype.element_ty)
        block = tl.load(table_ptr + row * table_stride + pos // BLOCK_SIZE).to(tl.int64)
        slot = block * cache_s0 + (pos % BLOCK_SIZE) * cache_s1 + kv_head * cache_s2
        tl.store(k_ptr + slot + d, k)
        tl.store(v_ptr + slot + d, v)
        g = tl.arange(0, GROUP_P2)
        in_group = (g < GROUP)[:, None]
        q_base = qkv_ptr + t * width + (kv_head * GROUP + g[:, None]) * D
        q = _norm_rope(tl.load(q_base + d[None, :], mask=in_group, other=0.0).to(tl.float32),
                       tl.load(q_base + partner[None, :], mask=in_group, other=0.0).to(tl.float32), qn[None, :],
                       qn_p[None, :], cos[None, :], sin[None, :], sign[None, :], eps, D)
        return q.to(k_ptr.dtype.element_ty), k, v

    @triton.jit
    def _pair_attention_kernel(qkv_ptr, qn_ptr, kn_ptr, inv_freq_ptr, rows_ptr, pos_ptr, table_ptr, k_ptr, v_ptr,
                               out_ptr, eps, scale, table_stride, cache_s0, cache_s1, cache_s2,
                               NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr,
                               GROUP_P2: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                               IEEE: tl.constexpr):
        # Token a (position 0) attends to itself alone: its output is its value. Token b (position 1) attends to
        # both, the scores of the cache's rounded keys and queries summed in fp32, the weights rounded as the
        # tensor cores take them (as paged_attention; IEEE, fp32: not rounded).
        a = 2 * tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        qn, qn_p = tl.load(qn_ptr + d).to(tl.float32), tl.load(qn_ptr + partner).to(tl.float32)
        kn, kn_p = tl.load(kn_ptr + d).to(tl.float32), tl.load(kn_ptr + partner).to(tl.float32)
        row = tl.load(rows_ptr + a).to(tl.int64)
        _, k_a, v_a = _pair_token(qkv_ptr, qn, qn_p, kn, kn_p, inv_freq_ptr, pos_ptr, table_ptr, k_ptr, v_ptr, a, row,
                                  kv_head, eps, table_stride, cache_s0, cache_s1, cache_s2, NUM_HEADS, NUM_KV, GROUP,
                                  GROUP_P2, D, BLOCK_SIZE)
        q_b, k_b, v_b = _pair_token(qkv_ptr, qn, qn_p, kn, kn_p, inv_freq_ptr, pos_ptr, table_ptr, k_ptr, v_ptr, a + 1,
                                    row, kv_head, eps, table_stride, cache_s0, cache_s1, cache_s2, NUM_HEADS, NUM_KV,
                                    GROUP, GROUP_P2, D, BLOCK_SIZE)
        q_b = q_b.to(tl.float32)
        s_a = tl.sum(q_b * k_a.to(tl.float32)[None, :], axis=1) * scale  # [GROUP_P2]
        s_b = tl.sum(q_b * k_b.to(tl.float32)[None, :], axis=1) * scale
        m = tl.maximum(s_a, s_b)
        p_a, p_b = tl.exp(s_a - m), tl.exp(s_b - m)
        denom = p_a + p_b
        if not IEEE:
            p_a, p_b = p_a.to(v_a.dtype).to(tl.float32), p_b.to(v_b.dtype).to(tl.float32)
        v_a, v_b = v_a.to(tl.float32)[None, :], v_b.to(tl.float32)[None, :]
        out_b = (p_a[:, None] * v_a + p_b[:, None] * v_b) / denom[:, None]
        g = tl.arange(0, GROUP_P2)
        in_group = (g < GROUP)[:, None]
        offs = (kv_head * GROUP + g[:, None]) * D + d[None, :]
        out_a = v_a + tl.zeros([GROUP_P2, D], tl.float32)
        tl.store(out_ptr + a * NUM_HEADS * D + offs, out_a.to(out_ptr.dtype.element_ty), mask=in_group)
        tl.store(out_ptr + (a + 1) * NUM_HEADS * D + offs, out_b.to(out_ptr.dtype.element_ty), mask=in_group)

"""Fused kernels of the GPU decode path (Triton), each with a plain-PyTorch twin of the same semantics.

The twins run on the CPU (the eager path) and are what the tests compare every kernel against. All kernels
work on a flat list of tokens; token t belongs to cache row `rows[t]` and sits at position `positions[t]`, so
one kernel serves prefill (many tokens per row), the talker step (one per row) and the code predictor.

KV caches are paged: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; row r's position p
lives in block `block_table[r, p // block_size]`, slot `p % block_size`.

Numerics: norms, RoPE, softmax and sampling in fp32; the residual stream is fp32; matrix products in the
weights' dtype (bf16 on the GPU) with fp32 accumulation.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twins are used
    triton = None


# Tests set this (with TRITON_INTERPRET=1 before triton is imported) to run the kernels on the CPU.
INTERPRET_ON_CPU = False


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET_ON_CPU)


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 (griddepcontrol in the language, `launch_pdl` in the launcher); torch 2.4-2.6 ship older."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


# Programmatic dependent launch (Hopper and newer) for the one-row decode step's kernels (fused_linear and
# decode_attention with pdl=True): each is launched while its predecessor still runs and waits for the
# predecessor's results (griddepcontrol.wait) before reading anything it produced and before writing anything; it
# lets its own successor launch once past that wait, so the launch latency hides behind the previous kernel.
# Measured in docs/perf-notes.md (entries 42, 45): -0.08 ms per 1.7B frame at one row, a little slower at 4-64
# rows (the unfused path), and slower still when the products also prefetched their weights into L2.
PDL = triton is not None and _triton_has_pdl()


def pdl_flags(t: torch.Tensor, pdl: bool) -> dict:
    """A launch's PDL arguments (the kernel's PDL flag, and the launcher's) for a request `pdl` on `t`'s device."""
    if pdl and PDL and t.is_cuda and _capability(t.device.index)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# ---- RMSNorm with a fused residual add ---------------------------------------------------------------------

def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = residual + x (fp32; residual None means x starts the stream); y = rmsnorm(residual') * w.
    x: [N, D] any float dtype; returns (y [N, D] out_dtype, residual' [N, D] fp32)."""
    N, D = x.shape
    if not use_triton(x):
        r = x.float() if residual is None else residual + x.float()
        return _rmsnorm_ref(r, weight, eps).to(out_dtype), r
    y = torch.empty(N, D, dtype=out_dtype, device=x.device)
    r_out = torch.empty(N, D, dtype=torch.float32, device=x.device)
    _add_rmsnorm_kernel[(N,)](x, residual if residual is not None else x, weight, y, r_out, D, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(D), num_warps=4)
    return y, r_out


def _rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, r_out_ptr, D, eps, HAS_RESIDUAL: tl.constexpr,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        tl.store(r_out_ptr + row * D + cols, x, mask=mask)
        var = tl.sum(x * x, axis=0) / D
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(var + eps) * w
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


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
        return _qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache,
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


def _qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                            num_heads):
    N = qkv.shape[0]
    _, block_size, num_kv, D = k_cache.shape
    parts = qkv.float().view(N, num_heads + 2 * num_kv, D)
    q = _rotate(_rmsnorm_ref(parts[:, :num_heads], q_norm, eps), positions, inv_freq)
    k = _rotate(_rmsnorm_ref(parts[:, num_heads:num_heads + num_kv], k_norm, eps), positions, inv_freq)
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
        return _paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions).to(out_dtype)
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


def _paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions):
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
        IEEE=k_cache.dtype == torch.float32, EARLY=_reads_early(N, max_positions),
        num_warps=_decode_attention_warps(N, max_positions), **pdl_flags(qkv, pdl))
    return out


def _store_then_attend_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                           num_heads, out_dtype):
    """decode_attention's and pair_attention's twin: the two kernels they fuse, in PyTorch."""
    q = _qk_norm_rope_store_ref(qkv, q_norm, k_norm, eps, inv_freq, rows, positions, block_table, k_cache, v_cache,
                                num_heads)
    return _paged_attention_ref(q, k_cache, v_cache, block_table, rows, positions).to(out_dtype)


def _reads_early(num_tokens: int, max_positions: int) -> bool:
    return num_tokens <= EARLY_MAX_TOKENS or (num_tokens in EARLY_SHORT_TOKENS and max_positions <= EARLY_MAX_POSITIONS)


def _decode_attention_warps(num_tokens: int, max_positions: int) -> int:
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


# ---- small-batch matrix products with their neighbours fused in -------------------------------------------

# Rows per program of the tensor-core kernel: more rows take more programs per column block.
FUSED_BLOCK_M = 64
# (BLOCK_M, N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, K ranges), the fastest of
# bench/fused_linear.py's candidates per shape of the 0.6B and 1.7B layers and heads on an H100 (docs/perf-notes.md,
# entries 38 and 69); other shapes take the heuristic in _fused_linear_tiles. K ranges: the K columns split among
# that many programs per column block (their sums added by the last to finish): the products of few columns and
# long rows (o, down) would otherwise leave most SMs without weights to read.
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
# no tensor cores, so a program can own as few as one output column and even the code predictor's N = 1024
# products spread over every SM. (N, K, swiglu) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), the fastest of
# bench/fused_linear.py's candidates with the weights read from memory, at one row (GEMV_TILES, docs/perf-notes.md
# entry 49) and at two (GEMV_TWO_ROW_TILES, entry 54; shapes not there take the one-row tiles); other shapes take
# _gemv_tiles' heuristic.
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
        out = _fused_linear_ref(x, weight, norm, eps, swiglu, residual, fp32_out)
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
    BLOCK_N, BLOCK_K, warps, stages, split = _fused_linear_tiles(BLOCK_M, N, K, swiglu)
    k_split = triton.cdiv(triton.cdiv(K, split), BLOCK_K) * BLOCK_K  # (each program's K range, whole K tiles)
    # (a column block's row blocks and K ranges run side by side)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), triton.cdiv(K, k_split))
    sq_in = out if squares is None else squares  # (out: a placeholder, not read)
    sq_out = torch.empty(grid[1], M, dtype=torch.float32, device=x.device) if squares_out else out
    partial, arrivals = out, out  # (placeholders, not read without SPLIT)
    if grid[2] > 1:
        partial = torch.empty(grid[2], M, 2 * N if swiglu else N, dtype=torch.float32, device=x.device)
        arrivals = _split_arrivals(x.device, grid[0] * grid[1])
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


def _fused_linear_tiles(BLOCK_M: int, N: int, K: int, swiglu: bool) -> tuple[int, int, int, int, int]:
    tiles = FUSED_LINEAR_TILES.get((BLOCK_M, N, K, swiglu))
    if tiles is not None:
        return tiles
    # (an fp32 [BLOCK_M, BLOCK_K] input tile per stage: 512 columns at 16 rows, fewer as the rows grow, within an
    # H100's shared memory; the 64-row default of 512 did not fit, perf-notes 55)
    BLOCK_K = min(512 if K % 512 == 0 else 128, max(16, 8192 // BLOCK_M), triton.next_power_of_2(K))
    return (16 if N <= 2048 else 32), BLOCK_K, 4, 3, 1


def _split_arrivals(device: torch.device, programs: int) -> torch.Tensor:
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


def _fused_linear_ref(x, weight, norm, eps, swiglu, residual, fp32_out=False):
    dtype = weight.dtype
    y = x.to(dtype) if norm is None else _rmsnorm_ref(x, norm, eps).to(dtype)
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


# ---- SwiGLU activation ---------------------------------------------------------------------------------------

def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] (gate then up) -> silu(gate) * up: [N, I] in gate_up's dtype (computed in fp32)."""
    N, two_i = gate_up.shape
    inter = two_i // 2
    if not use_triton(gate_up):
        g, u = gate_up.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
    out = torch.empty(N, inter, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(inter, BLOCK))](gate_up, out, inter, BLOCK=BLOCK, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

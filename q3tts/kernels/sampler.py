"""One fused kernel per sampling step: logits processors, temperature, top-k, top-p and the seeded draw.

Its twin is `q3tts.sampling` (the reference path): same processors, same counter-based noise, same draws for
the same logits. One documented difference: top-p keeps tied probabilities together (transformers breaks ties
by sort order), which can only matter when two probabilities are exactly equal at the top-p boundary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling import SamplerTensors, apply_talker_processors, sample
from .backend import triton, use_triton

if triton is not None:
    import triton.language as tl

SAMPLE_WARPS = 8  # warps per row's program (for A/B runs: bench/frame_parts.py --set kernels.sampler.SAMPLE_WARPS=4)
VALUE_PASSES = 6  # top-k's threshold passes spread in value before they spread in key (_top_k_threshold)


def sample_tokens(logits: torch.Tensor, params: SamplerTensors, seeds: torch.Tensor, counters: torch.Tensor,
                  talker: TalkerProcessors | None = None, offset: int = 0,
                  gather: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """logits: [B, V] fp32 raw. With `talker`, the repetition penalty / min-new-tokens / suppression are
    applied first and the drawn ids are marked in `talker.seen`. The draws' noise counters are counters + offset.
    `gather`: up to three (table [V', D], out [B, D]) pairs: out[b] = table[ids[b]] (the ids' embedding rows, in
    the same launch). Returns ids [B] int64."""
    B, V = logits.shape
    if len(gather) > 3:
        raise ValueError("sample_tokens gathers from at most three tables")
    if not use_triton(logits):
        if talker is not None:
            logits = apply_talker_processors(logits, talker.seen[:B], talker.penalty, talker.steps, talker.eos_id,
                                             talker.min_new_tokens, talker.suppress)
        ids = sample(logits, params, seeds, counters + offset)
        if talker is not None:
            talker.seen[torch.arange(B, device=ids.device), ids] = True
        for table, out in gather:
            out.copy_(table[ids])
        return ids
    if V >= 2**16:
        raise ValueError(f"the sampling kernel takes vocabularies below 65536 ids, got {V}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    t = talker
    tables = [(table, rows, table.shape[1]) for table, rows in gather]
    for table, rows, _ in tables:
        if not (table.is_contiguous() and rows.is_contiguous() and rows.shape == (B, table.shape[1])):
            raise ValueError("sample_tokens gathers contiguous table rows into a contiguous [B, D] output")
    (t1, o1, d1), (t2, o2, d2), (t3, o3, d3) = (tables + [(logits, logits, 1)] * 3)[:3]
    _sample_kernel[(B,)](
        logits, V, params.do_sample, params.temperature, params.top_k, params.top_p, seeds, counters, offset, out,
        t.seen if t else logits, t.penalty if t else logits, t.steps if t else logits,
        t.suppress if t else logits, t.eos_id if t else 0, t.min_new_tokens if t else 0, t1, o1, d1, t2, o2, d2,
        t3, o3, d3, HAS_PROCESSORS=t is not None, GATHER=len(gather), BLOCK_V=triton.next_power_of_2(V),
        BLOCK_D1=triton.next_power_of_2(d1), BLOCK_D2=triton.next_power_of_2(d2),
        BLOCK_D3=triton.next_power_of_2(d3), COUNT_BITS=count_bits(V), VALUE_PASSES=VALUE_PASSES,
        num_warps=SAMPLE_WARPS)
    return out


def count_bits(V: int) -> int:
    """The bits of each count that top-k packs into an int64 (_top_k_threshold): 12 (five counts a pass) while
    every count (<= V) fits them, else 16 (four; V < 2^16)."""
    return 12 if V < 4096 else 16


class TalkerProcessors:
    """The talker's logits processors for rows 0..B-1: seen [R, V] bool, penalty/steps [B], suppress [V] bool."""

    def __init__(self, seen: torch.Tensor, penalty: torch.Tensor, steps: torch.Tensor, suppress: torch.Tensor,
                 eos_id: int, min_new_tokens: int):
        self.seen, self.penalty, self.steps, self.suppress = seen, penalty, steps, suppress
        self.eos_id, self.min_new_tokens = eos_id, min_new_tokens


if triton is not None:
    @triton.jit
    def _mix32(x):
        """The twin's 32-bit mixing (sampling._mix32, in int64 there) on uint32: products wrap, shifts are logical."""
        x = (x ^ (x >> 16)) * 0x7FEB352D
        x = (x ^ (x >> 15)) * 0x5BD1E995
        return x ^ (x >> 16)

    @triton.jit
    def _ordered(x):
        """fp32 -> int64 key in [0, 2^32) with the same order as the floats (-0 the key of +0, as they compare
        equal)."""
        bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return tl.where(bits >= 0x80000000, (~bits) & 0xFFFFFFFF, bits | 0x80000000)

    @triton.jit
    def _unordered(key):
        """_ordered's inverse: the fp32 value of a key."""
        bits = tl.where(key >= 0x80000000, key & 0x7FFFFFFF, (~key) & 0xFFFFFFFF)
        return bits.to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _max_and_min(a, a_low, b, b_low):
        return tl.maximum(a, b), tl.minimum(a_low, b_low)

    @triton.jit
    def _threshold(j, lo, hi, lo_value, step, by_value, NT: tl.constexpr):
        """Threshold j (1..NT) of a top-k pass between keys lo and hi, as a value: lo_value + j step, or the value
        of the key lo + ~j / (NT + 1) of hi - lo (a product and a shift, no 64-bit division: below hi, and above
        lo for j = NT when hi - lo >= 2)."""
        SCALE: tl.constexpr = (1 << 18) // (NT + 1)
        return tl.where(by_value, lo_value + step * j, _unordered(lo + (((hi - lo) * (j * SCALE)) >> 18)))

    @triton.jit
    def keep_top_k(x, k, BITS: tl.constexpr, VALUE_PASSES: tl.constexpr):
        """(x with every score below the k-th largest -inf, max(x)) for 0 < k < V (with fewer than k finite
        scores, the finite ones kept)."""
        big, lowest = tl.reduce((x, tl.where(x > float("-inf"), x, float("inf"))), 0, _max_and_min)
        return tl.where(x >= _top_k_threshold(x, k, big, lowest, BITS, VALUE_PASSES), x, float("-inf")), big

    @triton.jit
    def _top_k_threshold(x, k, big, lowest, BITS: tl.constexpr, VALUE_PASSES: tl.constexpr):
        """A value v such that x >= v keeps the scores >= the k-th largest (0 < k < V; big, lowest: the largest
        and the lowest finite score; with fewer than k finite scores, every finite one). It narrows [lo, hi), keys
        (_ordered) with >= k and < k scores at or above them, over passes that each count the scores at or above
        NT thresholds in one reduction (BITS-bit counts packed in an int64; float comparisons): for the first
        VALUE_PASSES passes spread evenly in value between lo and hi, then (or where that makes no progress)
        evenly in key, which also ends ties (a run of equal scores at the k-th place can only end with hi = lo +
        1). It stops once a threshold has exactly k scores at or above it: for 2,048 or 3,072 spread logits ~4
        passes on average, ~6-7 for the slowest of 64 rows (docs/perf-notes.md, entry 94; the two-bit passes over
        the key that it replaces: ~8 and ~12)."""
        NT: tl.constexpr = 64 // BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        lo = _ordered(lowest)
        hi = _ordered(big) + 1  # (the key of the float after big)
        kept = tl.full([], -1, tl.int64)  # scores at or above lo, once counted
        passes = 0
        while (kept != k) & (hi - lo > 1):
            lo_value, hi_value = _unordered(lo), _unordered(hi)
            step = (tl.minimum(hi_value, big) - lo_value) / (NT + 1)
            by_value = (passes < VALUE_PASSES) & (lo_value + step > lo_value) & (lo_value + step * NT < hi_value)
            packed = tl.zeros(x.shape, tl.int64)
            for j in tl.static_range(1, NT + 1):
                packed += (x >= _threshold(j, lo, hi, lo_value, step, by_value, NT)).to(tl.int64) << ((j - 1) * BITS)
            counts = tl.sum(packed, axis=0)
            new_lo, new_hi = lo, hi
            for j in tl.static_range(1, NT + 1):  # thresholds rise with j, their counts fall
                t = _ordered(_threshold(j, lo, hi, lo_value, step, by_value, NT))
                c = (counts >> ((j - 1) * BITS)) & MASK
                new_lo = tl.where(c >= k, t, new_lo)
                kept = tl.where(c >= k, c, kept)
                new_hi = tl.where((c < k) & (t < new_hi), t, new_hi)
            lo, hi = new_lo, new_hi
            passes += 1
        return _unordered(lo)

    @triton.jit
    def _min_max_sum(a_sum, a_max, a_min, b_sum, b_max, b_min):
        return a_sum + b_sum, tl.maximum(a_max, b_max), tl.minimum(a_min, b_min)

    @triton.jit
    def keep_top_p(probs, limit):
        """probs (>= 0, summing to 1) without the low tail whose mass is <= limit (= 1 - top_p), ties together, the
        largest always kept (transformers' TopPLogitsWarper keeps at least one). A search for lo, the largest
        present probability with mass(p <= lo) <= limit, keeping hi above it (mass(p <= hi) > limit, or hi the
        largest) and rest, the lowest present probability in (lo, hi): each pass splits [rest, hi) at its middle
        in bits (mid, so the float's exponent halves first), and one reduction gives mass(p <= mid), the largest
        present at or below mid (hi's next value if the mass is too large) and the lowest above it (rest's, if
        not); every pass drops at least rest or the new hi from (lo, hi), and it stops once that holds none. The
        same cut as testing every bit of the key (32 reductions): ~7-8 passes over 2,048 or 3,072 probabilities
        after top-k 50, ~10 for the slowest of 64 rows; ~13 without top-k (~16). One reduction of three (tl.reduce)
        rather than three (tl.sum, max, min): faster on the GPU (docs/perf-notes.md, entry 99); Triton's CPU
        interpreter runs it an element at a time (the tests run it as a tree: tests/kernels/conftest.py)."""
        lo = tl.zeros([], tl.float32)
        hi = tl.max(probs, axis=0)
        rest = lo  # (a bound, not yet a present value: the first pass finds them)
        more = hi > lo
        while more:
            mid = ((rest.to(tl.int32, bitcast=True) + hi.to(tl.int32, bitcast=True)) >> 1).to(tl.float32,
                                                                                              bitcast=True)
            below = probs <= mid
            mass, top_below, low_above = tl.reduce(
                (tl.where(below, probs, 0.0), tl.where(below & (probs > lo), probs, -1.0),
                 tl.where(~below & (probs < hi), probs, float("inf"))), 0, _min_max_sum)
            if mass <= limit:
                lo, rest = mid, low_above
                more = low_above < hi
            else:
                hi = top_below
                more = rest < top_below
        return tl.where(probs <= lo, 0.0, probs)

    @triton.jit
    def _sample_kernel(logits_ptr, V, do_sample_ptr, temp_ptr, top_k_ptr, top_p_ptr, seed_ptr, counter_ptr, offset,
                       out_ptr, seen_ptr, penalty_ptr, steps_ptr, suppress_ptr, eos_id, min_new,
                       t1_ptr, o1_ptr, D1, t2_ptr, o2_ptr, D2, t3_ptr, o3_ptr, D3, HAS_PROCESSORS: tl.constexpr,
                       GATHER: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                       BLOCK_D3: tl.constexpr, COUNT_BITS: tl.constexpr,
                       VALUE_PASSES: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        valid = cols < V
        x = tl.load(logits_ptr + b * V + cols, mask=valid, other=float("-inf"))
        if HAS_PROCESSORS:
            seen = tl.load(seen_ptr + b * V + cols, mask=valid, other=0).to(tl.int1)
            penalty = tl.load(penalty_ptr + b)
            x = tl.where(seen, tl.where(x < 0, x * penalty, x / penalty), x)
            too_early = (cols == eos_id) & (tl.load(steps_ptr + b) < min_new)
            suppressed = tl.load(suppress_ptr + cols, mask=valid, other=0).to(tl.int1)
            x = tl.where(too_early | suppressed | ~valid, float("-inf"), x)
        if not tl.load(do_sample_ptr + b).to(tl.int1):
            token = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64)
        else:
            scores = x / tl.load(temp_ptr + b)
            k = tl.load(top_k_ptr + b)
            if (k > 0) & (k < V):
                scores, big = keep_top_k(scores, k, COUNT_BITS, VALUE_PASSES)
            else:
                big = tl.max(scores, axis=0)
            if big == float("inf"):  # (as the twin: overflowed scores, their limit: the largest processed logits)
                scores = tl.where(x == tl.max(x, axis=0), 0.0, float("-inf"))
                big = 0.0
            probs = tl.exp(scores - big)  # (top-k keeps the largest)
            probs = probs / tl.sum(probs, axis=0)
            top_p = tl.load(top_p_ptr + b)
            if top_p < 1.0:
                probs = keep_top_p(probs, 1.0 - top_p)
            seed = tl.load(seed_ptr + b)
            h = _mix32((tl.load(counter_ptr + b) + offset).to(tl.uint32) ^ _mix32(cols.to(tl.uint32) + 0x3C6EF372))
            h = _mix32(h ^ seed.to(tl.uint32))
            h = _mix32(h ^ (seed >> 32).to(tl.uint32) ^ 0x1B873593)
            u = ((h >> 9).to(tl.float32) + 0.5) / 8388608.0  # strictly inside (0, 1), as the twin
            race = tl.where(valid & (probs > 0), probs / -tl.log(u), -1.0)
            token = tl.argmax(race, axis=0, tie_break_left=True).to(tl.int64)
        tl.store(out_ptr + b, token)
        if HAS_PROCESSORS:
            tl.store(seen_ptr + b * V + token, 1)
        if GATHER >= 1:
            d = tl.arange(0, BLOCK_D1)
            tl.store(o1_ptr + b * D1 + d, tl.load(t1_ptr + token * D1 + d, mask=d < D1), mask=d < D1)
        if GATHER >= 2:
            d = tl.arange(0, BLOCK_D2)
            tl.store(o2_ptr + b * D2 + d, tl.load(t2_ptr + token * D2 + d, mask=d < D2), mask=d < D2)
        if GATHER >= 3:
            d = tl.arange(0, BLOCK_D3)
            tl.store(o3_ptr + b * D3 + d, tl.load(t3_ptr + token * D3 + d, mask=d < D3), mask=d < D3)

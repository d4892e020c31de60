"""The paged-attention kernels (prefill, decode, pairs) against their PyTorch twins, and the twin against PyTorch's
attention (tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import attention  # noqa: E402
from tests.kernels.twins import DEVICE, DTYPES, close, twin  # noqa: E402


def _paged_setup(dtype, num_tokens_per_row, num_heads=4, num_kv=2, D=32, block_size=16, seed=0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    R = len(num_tokens_per_row)
    max_blocks = 6
    num_blocks = R * max_blocks + 1
    # Rows own shuffled, non-contiguous blocks; block 0 is never used.
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))[: R * max_blocks] + 1
    table = perm.view(R, max_blocks).to(torch.int32).to(DEVICE)
    rows, positions = [], []
    for r, n in enumerate(num_tokens_per_row):
        rows += [r] * n
        positions += list(range(n))
    rows = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    N = rows.numel()
    qkv = torch.randn(N, (num_heads + 2 * num_kv) * D, device=DEVICE, generator=g).to(dtype)
    qn = (1 + 0.1 * torch.randn(D, device=DEVICE, generator=g)).to(dtype)
    kn = (1 + 0.1 * torch.randn(D, device=DEVICE, generator=g)).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEVICE).float() / D))
    cache = lambda: torch.full((num_blocks, block_size, num_kv, D), float("nan"), dtype=dtype, device=DEVICE)
    return dict(qkv=qkv, q_norm=qn, k_norm=kn, eps=1e-6, inv_freq=inv_freq, rows=rows, positions=positions,
                block_table=table, k_cache=cache(), v_cache=cache(), num_heads=num_heads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store_and_attention(monkeypatch, dtype):
    args = _paged_setup(dtype, [7, 1, 37])
    ref_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    q = attention.qk_norm_rope_store(**args)
    q_ref = twin(monkeypatch, attention.qk_norm_rope_store, **ref_args)
    close(q, q_ref, dtype)
    written = ~torch.isnan(ref_args["k_cache"])
    assert torch.equal(written, ~torch.isnan(args["k_cache"]))  # exactly the same slots written
    close(args["k_cache"][written], ref_args["k_cache"][written], dtype)
    assert torch.equal(args["v_cache"][written], ref_args["v_cache"][written])
    out = attention.paged_attention(q, args["k_cache"], args["v_cache"], args["block_table"], args["rows"],
                                  args["positions"], dtype)
    out_ref = twin(monkeypatch, attention.paged_attention, q_ref, ref_args["k_cache"], ref_args["v_cache"],
                    args["block_table"], args["rows"], args["positions"], dtype)
    close(out, out_ref, dtype)


@pytest.mark.parametrize("query_rows", [8, 64])
def test_attention_runs_of_a_rows_tokens(monkeypatch, query_rows):
    """Tokens of one row at consecutive positions attend together (in spans of query_rows // 2 tokens here): a
    prefill after a cached prefix (positions from 21 on), runs broken by another row's tokens, by a gap in the
    positions or a repeated one (a bucket's padding tokens: one row, position 0), rows of one token, and a run
    crossing several spans and KV blocks; each token gets the twin's attention over its own positions."""
    monkeypatch.setattr(attention, "ATTENTION_QUERY_ROWS", query_rows)
    dtype = DTYPES[-1]
    layout = ([(0, p) for p in range(21, 45)] + [(1, 0), (1, 1), (2, 5), (1, 2), (1, 3), (3, 9)]
              + [(2, p) for p in range(6, 11)] + [(2, p) for p in range(13, 17)] + [(4, 0)] * 3)
    args = _paged_setup(dtype, [45, 4, 17, 10, 1], seed=5)  # (every row's keys written: the cached positions too)
    q = twin(monkeypatch, attention.qk_norm_rope_store, **args)
    first = {r: sum([45, 4, 17, 10, 1][:r]) for r in range(5)}
    index = torch.tensor([first[r] + p for r, p in layout], dtype=torch.long, device=DEVICE)
    rows, positions = args["rows"][index], args["positions"][index]
    out = attention.paged_attention(q[index], args["k_cache"], args["v_cache"], args["block_table"], rows, positions,
                                  dtype)
    ref = twin(monkeypatch, attention.paged_attention, q[index], args["k_cache"], args["v_cache"],
                args["block_table"], rows, positions, dtype)
    close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mixed", "many_short", "short_64", "one_0", "one_15", "one_16", "one_36"])
def test_decode_attention_equals_store_then_attend(monkeypatch, dtype, case):
    """The fused decode kernel against the twin of the two kernels it replaces: one new token per row, each
    row with its earlier positions already in the cache (written first, as the frames before did); rows of
    different lengths, 70 rows of one block each (as the code predictor's; launched with fewer warps), 64 rows of
    two blocks (their first blocks read early), and one token alone (its first block read early, its own position
    from registers) with 0, 15, 16 (its own position the first of the second block) and 36 positions before it."""
    history = {"mixed": [6, 0, 36, 16], "many_short": [(7 * r) % 16 for r in range(70)],
               "short_64": [(5 * r) % 32 for r in range(64)]}.get(case)
    history = history or [int(case.split("_")[1])]
    args = _paged_setup(dtype, [n + 1 for n in history], seed=3)
    if case == "many_short":
        args["block_table"] = args["block_table"][:, :1]
        assert attention.decode_attention_warps(len(history), 16) == attention.SHORT_CONTEXT_WARPS
    if case == "short_64":
        args["block_table"] = args["block_table"][:, :2]
        assert attention.reads_early(len(history), 32)
    first = [sum(n + 1 for n in history[:r]) for r in range(len(history))]
    old = torch.tensor([i for r, n in enumerate(history) for i in range(first[r], first[r] + n)], dtype=torch.long,
                       device=DEVICE)
    new = torch.tensor([first[r] + n for r, n in enumerate(history)], dtype=torch.long, device=DEVICE)
    pick = lambda index: {**args, "qkv": args["qkv"][index], "rows": args["rows"][index],
                          "positions": args["positions"][index]}
    twin(monkeypatch, attention.qk_norm_rope_store, **pick(old))  # the history, in both caches
    ref = {**pick(new), "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out = attention.decode_attention(**pick(new), out_dtype=dtype)
    out_ref = twin(monkeypatch, attention.decode_attention, **ref, out_dtype=dtype)
    close(out, out_ref, dtype)
    _same_cache_writes(args, ref, dtype)


def _same_cache_writes(args: dict, ref: dict, dtype) -> None:
    """The kernel wrote the twin's cache slots (NaN elsewhere in both), keys within `dtype`, values bit for bit."""
    written = ~torch.isnan(ref["k_cache"])
    assert torch.equal(written, ~torch.isnan(args["k_cache"]))
    close(args["k_cache"][written], ref["k_cache"][written], dtype)
    assert torch.equal(args["v_cache"][written], ref["v_cache"][written])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads", [4, 6])
def test_pair_attention_equals_store_then_attend(monkeypatch, dtype, num_heads):
    """The one-launch attention of rows' first two positions in pairs (the code predictor's first pass) against the
    twin of the two kernels it replaces: shuffled blocks, the rest of each cache unwritten (NaN: never read), two
    or three query heads per KV head."""
    args = _paged_setup(dtype, [2] * 5, num_heads=num_heads, seed=4)
    ref = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out = attention.pair_attention(**args, out_dtype=dtype)
    out_ref = twin(monkeypatch, attention.pair_attention, **ref, out_dtype=dtype)
    close(out, out_ref, dtype)
    _same_cache_writes(args, ref, dtype)
    with pytest.raises(ValueError, match="pairs"):
        attention.pair_attention(**{**args, "qkv": args["qkv"][:3], "rows": args["rows"][:3],
                                  "positions": args["positions"][:3]}, out_dtype=dtype)


def test_attention_twin_matches_sdpa():
    """The twin itself against PyTorch's attention on contiguous keys."""
    args = _paged_setup(torch.float32, [9])
    q = attention.qk_norm_rope_store_ref(**args)
    out = attention.paged_attention_ref(q, args["k_cache"], args["v_cache"], args["block_table"], args["rows"],
                                        args["positions"])
    blocks = args["block_table"][0, torch.arange(9, device=DEVICE) // 16].long()
    k = args["k_cache"][blocks, torch.arange(9, device=DEVICE) % 16].transpose(0, 1)  # [kv, 9, D]
    v = args["v_cache"][blocks, torch.arange(9, device=DEVICE) % 16].transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                                           is_causal=True, enable_gqa=True)
    close(out.view(9, 4, 32), ref[0].transpose(0, 1), torch.float32)

"""Every Triton kernel of the GPU path against its PyTorch twin.

On the CPU the kernels run in Triton's interpreter (fp32; the interpreter mishandles bf16), on the GPU
(Q3TTS_GPU_TESTS=1) natively in bf16 and fp32. Inputs are fresh random data, outputs are poisoned first.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import activation, attention, backend, linear, norm  # noqa: E402
from q3tts.kernels import codec as codec_kernels  # noqa: E402
from q3tts.kernels.sampler import TalkerProcessors, sample_tokens  # noqa: E402
from q3tts.sampling import SamplerTensors, SamplingParams  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE == "cpu":  # conftest set TRITON_INTERPRET=1 before triton was imported
        monkeypatch.setattr(backend, "INTERPRET_ON_CPU", True)


def _twin(monkeypatch, fn, *args, **kwargs):
    """Runs `fn` with the Triton path switched off (the PyTorch twin)."""
    with monkeypatch.context() as m:
        m.setattr(backend, "USE_TWINS", True)
        return fn(*args, **kwargs)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
    assert err < tol, err


def _close_chained(a: torch.Tensor, b: torch.Tensor, layers: int) -> None:
    """bf16 caches at the end of a chain of layers computed in two orders (fp32 sums rounded in other places): within
    1% over the whole tensor (a wrong row or head is several times that), and at the largest element within 1% after
    a code predictor's 5 layers, 3% after a talker's 28 (where one element's roundings compound)."""
    diff = a.float() - b.float()
    assert float(diff.norm() / b.float().norm()) < 1e-2
    assert float(diff.abs().max() / b.float().abs().max()) < (1e-2 if layers <= 5 else 3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm(monkeypatch, dtype, with_residual):
    g = torch.Generator(DEVICE).manual_seed(1)
    x = torch.randn(5, 96, device=DEVICE, generator=g).to(dtype)
    res = torch.randn(5, 96, device=DEVICE, generator=g) if with_residual else None
    w = (1 + 0.1 * torch.randn(96, device=DEVICE, generator=g)).to(dtype)
    y, r = norm.add_rmsnorm(x, res, w, 1e-6, dtype)
    y_ref, r_ref = _twin(monkeypatch, norm.add_rmsnorm, x, res, w, 1e-6, dtype)
    _close(y, y_ref, dtype)
    assert torch.equal(r, r_ref)


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
    q_ref = _twin(monkeypatch, attention.qk_norm_rope_store, **ref_args)
    _close(q, q_ref, dtype)
    written = ~torch.isnan(ref_args["k_cache"])
    assert torch.equal(written, ~torch.isnan(args["k_cache"]))  # exactly the same slots written
    _close(args["k_cache"][written], ref_args["k_cache"][written], dtype)
    assert torch.equal(args["v_cache"][written], ref_args["v_cache"][written])
    out = attention.paged_attention(q, args["k_cache"], args["v_cache"], args["block_table"], args["rows"],
                                  args["positions"], dtype)
    out_ref = _twin(monkeypatch, attention.paged_attention, q_ref, ref_args["k_cache"], ref_args["v_cache"],
                    args["block_table"], args["rows"], args["positions"], dtype)
    _close(out, out_ref, dtype)


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
    q = _twin(monkeypatch, attention.qk_norm_rope_store, **args)
    first = {r: sum([45, 4, 17, 10, 1][:r]) for r in range(5)}
    index = torch.tensor([first[r] + p for r, p in layout], dtype=torch.long, device=DEVICE)
    rows, positions = args["rows"][index], args["positions"][index]
    out = attention.paged_attention(q[index], args["k_cache"], args["v_cache"], args["block_table"], rows, positions,
                                  dtype)
    ref = _twin(monkeypatch, attention.paged_attention, q[index], args["k_cache"], args["v_cache"],
                args["block_table"], rows, positions, dtype)
    _close(out, ref, dtype)


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
    _twin(monkeypatch, attention.qk_norm_rope_store, **pick(old))  # the history, in both caches
    ref = {**pick(new), "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    out = attention.decode_attention(**pick(new), out_dtype=dtype)
    out_ref = _twin(monkeypatch, attention.decode_attention, **ref, out_dtype=dtype)
    _close(out, out_ref, dtype)
    _same_cache_writes(args, ref, dtype)


def _same_cache_writes(args: dict, ref: dict, dtype) -> None:
    """The kernel wrote the twin's cache slots (NaN elsewhere in both), keys within `dtype`, values bit for bit."""
    written = ~torch.isnan(ref["k_cache"])
    assert torch.equal(written, ~torch.isnan(args["k_cache"]))
    _close(args["k_cache"][written], ref["k_cache"][written], dtype)
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
    out_ref = _twin(monkeypatch, attention.pair_attention, **ref, out_dtype=dtype)
    _close(out, out_ref, dtype)
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
    _close(out.view(9, 4, 32), ref[0].transpose(0, 1), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(monkeypatch, dtype):
    x = torch.randn(3, 2 * 1500, device=DEVICE).to(dtype)
    _close(activation.silu_mul(x), _twin(monkeypatch, activation.silu_mul, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("kind", ["plain", "norm", "norm_in_dtype", "swiglu", "residual", "residual_in_dtype",
                                  "logits"])
def test_fused_linear(monkeypatch, dtype, M, kind):
    """The small-batch product with its fused neighbours against the unfused twin; K not a multiple of the
    K tile, N not a multiple of the N tile, so every mask is exercised."""
    g = torch.Generator(DEVICE).manual_seed(M)
    K, N = (200, 2 * 40) if kind == "swiglu" else (1024 if M == 16 else 200, 72)
    w = (0.1 * torch.randn(N, K, device=DEVICE, generator=g)).to(dtype)
    x = torch.randn(M, K, device=DEVICE, generator=g)
    kwargs = {}
    if kind in ("norm", "norm_in_dtype", "swiglu"):
        kwargs = dict(norm=(1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype), eps=1e-6)
    if kind not in ("norm", "swiglu"):  # (the stream in fp32, or a first layer's input in the weights' dtype)
        x = x.to(dtype)
    if kind == "swiglu":
        kwargs["swiglu"] = True
    if kind.startswith("residual"):  # the stream in fp32, or a first layer's input in the weights' dtype
        kwargs["residual"] = torch.randn(M, N, device=DEVICE, generator=g)
        if kind == "residual_in_dtype":
            kwargs["residual"] = kwargs["residual"].to(dtype)
    if kind == "logits":
        kwargs["fp32_out"] = True
    out = linear.fused_linear(x, w, **kwargs)
    ref = _twin(monkeypatch, linear.fused_linear, x, w, **kwargs)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (M, N // 2 if kind == "swiglu" else N)
    if kind == "logits":  # not rounded to the weights' dtype: as close as fp32 sums in another order
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    _close(out, ref, dtype)


@pytest.mark.parametrize("M", [5, 40])
def test_fused_linear_hands_on_sums_of_squares(monkeypatch, M):
    """Beyond the matrix-vector kernel's rows: a residual add's partial sums of squares (squares_out) add up to its
    output rows' sums of squares, and a norm that takes them (squares), or row_squares' of its input, or every
    other row's of either, or none (the kernel reads its rows), equals the unfused twin; 40 rows span several row
    blocks (FUSED_BLOCK_M 16 here)."""
    monkeypatch.setattr(linear, "FUSED_BLOCK_M", 16)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(M)
    K, N = 200, 72
    x = torch.randn(M, K, device=DEVICE, generator=g).to(dtype)
    w_o = (0.1 * torch.randn(N, K, device=DEVICE, generator=g)).to(dtype)
    stream = torch.randn(M, N, device=DEVICE, generator=g) * torch.linspace(0.1, 10, M, device=DEVICE)[:, None]
    residual, squares = linear.fused_linear(x, w_o, residual=stream, squares_out=True)
    assert squares.shape == (-(-N // linear.fused_linear_tiles(16, N, K, False)[0]), M)
    torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)
    _close(residual, _twin(monkeypatch, linear.fused_linear, x, w_o, residual=stream), dtype)
    w = (0.1 * torch.randn(2 * 40, N, device=DEVICE, generator=g)).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(N, device=DEVICE, generator=g)).to(dtype)
    first = torch.randn(M, N, device=DEVICE, generator=g)
    for inputs, sums in ((residual, squares), (first, linear.row_squares(first)), (first, None),
                         (residual[1::2], squares[:, 1::2]), (first[1::2], linear.row_squares(first)[:, 1::2])):
        for kwargs in (dict(norm=norm_w, eps=1e-6, swiglu=True), dict(norm=norm_w, eps=1e-6, fp32_out=True)):
            out = linear.fused_linear(inputs, w, squares=sums, **kwargs)
            _close(out, _twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)
    with pytest.raises(ValueError, match="squares_out"):
        linear.fused_linear(x, w_o, squares_out=True)
    with pytest.raises(ValueError, match="squares"):
        linear.fused_linear(x, w_o, squares=squares)


@pytest.mark.parametrize("tiles", sorted(set(linear.FUSED_LINEAR_TILES.values())))
def test_fused_linear_with_each_measured_tile(monkeypatch, tiles):
    """Every tile shape of the measured table computes the same product (K a multiple of the K tile, as in the
    real layers; N not a multiple of the N tile), SwiGLU and residual forms alike."""
    monkeypatch.setattr(linear, "fused_linear_tiles", lambda *args: tiles)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(7)
    K = 2 * tiles[1]
    w = (0.1 * torch.randn(2 * 40, K, device=DEVICE, generator=g)).to(dtype)
    x = torch.randn(3, K, device=DEVICE, generator=g)
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
    for kwargs, inputs in ((dict(norm=norm, eps=1e-6, swiglu=True), x),
                           (dict(residual=torch.randn(3, 80, device=DEVICE, generator=g)), x.to(dtype))):
        out = linear.fused_linear(inputs, w, **kwargs)
        _close(out, _twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)


@pytest.mark.parametrize("split", [2, 3, 4])
def test_fused_linear_split_over_k(monkeypatch, split):
    """The K columns split among several programs per column block (the last to finish adds the ranges' sums,
    in order): the same products as the twin, every fused neighbour, K not a multiple of the ranges (the last one
    short), several row and column blocks; the partial sums of squares handed on add up; the counters are back at
    zero after each call, so the next call (and a captured graph's next replay) starts clean."""
    monkeypatch.setattr(linear, "FUSED_BLOCK_M", 16)
    monkeypatch.setattr(linear, "fused_linear_tiles", lambda *args: (16, 32, 4, 2, split))
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(split)
    M, K, N = 20, 200, 40
    x = torch.randn(M, K, device=DEVICE, generator=g) * torch.linspace(0.1, 10, M, device=DEVICE)[:, None]
    norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
    w = (0.1 * torch.randn(2 * N, K, device=DEVICE, generator=g)).to(dtype)
    stream = torch.randn(M, 2 * N, device=DEVICE, generator=g)
    for kwargs, inputs in ((dict(norm=norm, eps=1e-6, swiglu=True, squares=linear.row_squares(x)), x),
                           (dict(norm=norm, eps=1e-6), x), (dict(norm=norm, eps=1e-6, fp32_out=True), x),
                           (dict(residual=stream), x.to(dtype)), ({}, x.to(dtype))):
        out = linear.fused_linear(inputs, w, **kwargs)
        kwargs.pop("squares", None)
        _close(out, _twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)
        assert not linear.split_arrivals(out.device, 1).any()
    residual, squares = linear.fused_linear(x.to(dtype), w, residual=stream, squares_out=True)
    torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("tiles", [(1, 64, 4, 3), (2, 128, 2, 2), (8, 256, 8, 4)]
                         + sorted(set(linear.GEMV_TILES.values()) | set(linear.GEMV_TWO_ROW_TILES.values())))
def test_gemv_with_each_tile(monkeypatch, tiles):
    """The matrix-vector kernel computes the same product with every tile shape, for one row and two: the
    measured ones and a few small ones the interpreter can run (K a multiple of the K tile or not, N not a
    multiple of the N tile), every fused neighbour, the norm of each row its own."""
    monkeypatch.setattr(linear, "_gemv_tiles", lambda *args: tiles)
    dtype = DTYPES[-1]
    g = torch.Generator(DEVICE).manual_seed(11)
    for M, K in [(M, K) for M in range(1, linear.GEMV_MAX_ROWS + 1) for K in (2 * tiles[1], tiles[1] + 40)]:
        w = (0.1 * torch.randn(2 * 37, K, device=DEVICE, generator=g)).to(dtype)
        x = torch.randn(M, K, device=DEVICE, generator=g) * torch.tensor([1.0, 30.0][:M], device=DEVICE)[:, None]
        norm = (1 + 0.1 * torch.randn(K, device=DEVICE, generator=g)).to(dtype)
        for kwargs, inputs in ((dict(norm=norm, eps=1e-6, swiglu=True), x), (dict(norm=norm, eps=1e-6), x),
                               (dict(residual=torch.randn(M, 74, device=DEVICE, generator=g)), x.to(dtype)),
                               ({}, x.to(dtype)), (dict(fp32_out=True), x.to(dtype)),
                               (dict(norm=norm, eps=1e-6, fp32_out=True), x)):
            out = linear.fused_linear(inputs, w, **kwargs)
            _close(out, _twin(monkeypatch, linear.fused_linear, inputs, w, **kwargs), dtype)


def _params() -> list[SamplingParams]:
    rows = [dict(do_sample=False), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_k=0, top_p=0.8),
            dict(temperature=0.9, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=1),
            dict(temperature=0.9, top_k=50), dict(temperature=2.0, top_k=3000, top_p=0.5),
            dict(temperature=1.0, top_k=0, top_p=1e-7)]  # (its tail's mass rounds to 1 - top_p: the largest kept)
    return [SamplingParams(**r, seed=100 + i) for i, r in enumerate(rows * 2)]  # (each setting, two seeds)


# (a test each: the interpreter takes ~30-60 s over a trial; trial 2, a second nonzero offset beside trial 1's, dropped)
@pytest.mark.slow(reason="the sampling kernel in the Triton interpreter, a trial each (tests/SLOW.md)")
@pytest.mark.parametrize("trial", [0, 1, 3])
@pytest.mark.parametrize("with_processors", [False, True])
def test_sampling_kernel_matches_twin(monkeypatch, with_processors, trial):
    """The kernel draws the twin's tokens: greedy, temperature, top-k (with and without ties at the boundary: trial
    3), top-p, and the talker's processors; its noise counters offset, and the drawn ids' rows gathered from three
    tables in the same launch."""
    V = 3072 if with_processors else 2048
    params = _params()
    B = len(params)
    p = SamplerTensors.build(params, False, DEVICE)
    seeds = torch.tensor([x.seed for x in params], device=DEVICE)
    logits = torch.randn(B, V, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(trial)) * 3
    if trial == 3:  # ties across the top-k boundary (its passes cannot stop early there)
        logits = logits.round()
    counters = torch.full((B,), trial * 16, device=DEVICE)
    offset = 3 * trial  # (the twin's counters are counters + offset)
    tables = [torch.randn(V, 24, device=DEVICE).to(DTYPES[-1]), torch.randn(V, 40, device=DEVICE),
              torch.randn(V, 96, device=DEVICE).to(DTYPES[-1])]
    gathered = [torch.zeros(B, t.shape[1], dtype=t.dtype, device=DEVICE) for t in tables]
    procs = twin_procs = None
    if with_processors:
        seen = torch.rand(B, V, device=DEVICE) < 0.01
        suppress = torch.zeros(V, dtype=torch.bool, device=DEVICE)
        suppress[V - 1024:] = True
        suppress[2150] = False
        steps = torch.arange(B, device=DEVICE) % 4
        penalty = torch.full((B,), 1.05, device=DEVICE)
        procs = TalkerProcessors(seen.clone(), penalty, steps, suppress, 2150, 2)
        twin_procs = TalkerProcessors(seen.clone(), penalty, steps, suppress, 2150, 2)
    ids = sample_tokens(logits, p, seeds, counters, procs, offset=offset, gather=list(zip(tables, gathered)))
    ref = _twin(monkeypatch, sample_tokens, logits, p, seeds, counters + offset, twin_procs)
    rows = p.top_p >= 1 if trial == 3 else slice(None)  # (with ties, top-p keeps them together: sampler.py)
    assert torch.equal(ids[rows], ref[rows]), (trial, (ids != ref).nonzero().flatten().tolist())
    for table, rows_out in zip(tables, gathered):
        assert torch.equal(rows_out, table[ids])
    if with_processors:
        assert torch.equal(procs.seen[rows], twin_procs.seen[rows])


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the interpreter: the overflow tested,
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # and top-k's search from inf)
def test_scores_that_overflow_draw_the_largest_logits(monkeypatch):
    """A temperature (or a repetition penalty on a seen token) so far below 1 that the largest scores overflow to
    inf draws what its limit draws, the largest processed logit, in the kernel as in the twin (they once drew id 0:
    softmax of inf is NaN), with top-k and without."""
    B, V = 4, 3072
    g = torch.Generator(DEVICE).manual_seed(0)
    logits = torch.randn(B, V, device=DEVICE, generator=g) * 3
    params = [SamplingParams(temperature=1e-38, top_k=k, seed=i) for i, k in enumerate((50, 0, 50, 0))]
    p = SamplerTensors.build(params, False, DEVICE)
    seeds, counters = torch.arange(B, device=DEVICE), torch.zeros(B, dtype=torch.long, device=DEVICE)
    ids = sample_tokens(logits, p, seeds, counters)
    assert torch.equal(ids, _twin(monkeypatch, sample_tokens, logits, p, seeds, counters))
    assert torch.equal(ids, logits.argmax(-1))
    seen = torch.zeros(B, V, dtype=torch.bool, device=DEVICE)
    seen[:, :8] = True  # (a penalty of 1e-38 on positive logits: inf)
    logits[:, :8] = torch.arange(1, 9, device=DEVICE, dtype=torch.float32)
    procs = [TalkerProcessors(seen.clone(), torch.full((B,), 1e-38, device=DEVICE), torch.full((B,), 5, device=DEVICE),
                              torch.zeros(V, dtype=torch.bool, device=DEVICE), V - 1, 2) for _ in range(2)]
    p = SamplerTensors.build([SamplingParams(seed=i) for i in range(B)], False, DEVICE)
    ids = sample_tokens(logits, p, seeds, counters, procs[0])
    assert torch.equal(ids, _twin(monkeypatch, sample_tokens, logits, p, seeds, counters, procs[1]))
    assert bool((ids < 8).all())  # (the seen positive logits, overflowed alike: a draw among them)


if backend.triton is not None:
    import triton.language as tl

    from q3tts.kernels import sampler

    @backend.triton.jit
    def _kept_by_top_k(x_ptr, V, k_ptr, out_ptr, BLOCK_V: tl.constexpr, BITS: tl.constexpr,
                       VALUE_PASSES: tl.constexpr):
        """out[b] = which of row b's scores the sampling kernel's top-k keeps (k_ptr[b])."""
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        valid = cols < V
        x = tl.load(x_ptr + b * V + cols, mask=valid, other=float("-inf"))
        kept, _ = sampler.keep_top_k(x, tl.load(k_ptr + b), BITS, VALUE_PASSES)
        tl.store(out_ptr + b * V + cols, (kept > float("-inf")).to(tl.int8), mask=valid)


    @backend.triton.jit
    def _kept_by_top_p(p_ptr, V, limit_ptr, out_ptr, BLOCK_V: tl.constexpr):
        """out[b] = which of row b's probabilities the sampling kernel's top-p keeps (limit_ptr[b] = 1 - top_p)."""
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        valid = cols < V
        probs = tl.load(p_ptr + b * V + cols, mask=valid, other=0.0)
        kept = sampler.keep_top_p(probs, tl.load(limit_ptr + b))
        tl.store(out_ptr + b * V + cols, (kept > 0).to(tl.int8), mask=valid)


@pytest.mark.parametrize("V", [2048, 3072])
def test_top_p_keeps_what_transformers_keeps_at_the_edges(V):
    """The sampling kernel's top-p search keeps what transformers' TopPLogitsWarper keeps (the probabilities above
    the low tail whose mass is <= 1 - top_p, at least one): after top-k 50 and without it, a top-p so small that
    the whole tail's mass rounds to the limit (only the largest kept), one so close to 1 that only the smallest of
    thousands go, a tail whose mass equals the limit exactly (ties inside it), a single nonzero probability."""
    if backend.triton is None:
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(V)
    x = torch.randn(7, V, generator=g) * 3
    x[0] = torch.where(x[0] >= x[0].topk(50).values[-1], x[0], float("-inf"))
    x[1] /= 3
    probs = x.softmax(-1)
    probs[5] = 0
    probs[5, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125])  # (mass 0.25 at or below 0.125)
    probs[6] = 0
    probs[6, V // 2] = 1.0
    limits = 1 - torch.tensor([0.9, 0.5, 1e-9, 0.999999, 0.6, 0.75, 0.5])  # (fp32, as the kernel's 1 - top_p)
    out = torch.zeros(len(probs), V, dtype=torch.int8, device=DEVICE)
    _kept_by_top_p[(len(probs),)](probs.to(DEVICE), V, limits.to(DEVICE), out,
                                  BLOCK_V=backend.triton.next_power_of_2(V))
    out = out.cpu()
    ascending, order = probs.sort(-1)
    removed = ascending.cumsum(-1) <= limits[:, None]
    removed[:, -1] = False
    expected = ~removed.scatter(1, order, removed)
    assert torch.equal(out.bool(), expected), (V, (out.bool() != expected).any(-1).nonzero().tolist())
    assert out[2].sum() == 1 and out[2, probs[2].argmax()] == 1
    assert out[5].tolist()[:4] == [1, 1, 0, 0] and 0 < (~out[3].bool()).sum() < V - 50


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the interpreter, at +-3e38)
def test_top_k_keeps_the_k_largest_at_the_edges():
    """The sampling kernel's top-k threshold search keeps what the twin keeps (every score >= the k-th largest)
    where its passes cannot stop early or its spacing in value makes no progress: ties, values one float apart, -0
    beside +0, fewer finite scores than k (the finite ones), a range beyond fp32's, k = 1 and V - 1, and a
    vocabulary of 4,096 or more (16-bit counts)."""
    if backend.triton is None:
        pytest.skip("no Triton")
    g = torch.Generator().manual_seed(0)
    after_one = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    for V in (2048, 4100):
        x = torch.randn(6, V, generator=g) * 3
        x[0] = x[0].round()  # ties
        x[1] = torch.where(torch.rand(V, generator=g) < 0.5, 1.0, after_one)  # one float apart
        x[2] = torch.where(torch.rand(V, generator=g) < 0.5, 0.0, -0.0) * (torch.rand(V, generator=g) < 0.9)
        x[2, :40] = 1.0
        x[3, : V - 30] = float("-inf")  # 30 finite scores
        x[4] *= 1e37
        x[4, :2] = torch.tensor([3e38, -3e38])
        x = x.to(DEVICE)
        for k in (1, 50, V - 1):
            ks = torch.full((6,), k, device=DEVICE)
            out = torch.zeros(6, V, dtype=torch.int8, device=DEVICE)
            _kept_by_top_k[(6,)](x, V, ks, out, BLOCK_V=backend.triton.next_power_of_2(V),
                                 BITS=sampler.count_bits(V), VALUE_PASSES=sampler.VALUE_PASSES)
            kth = x.sort(dim=-1, descending=True).values[:, k - 1 : k]
            expected = (x >= kth) & (x > float("-inf"))
            assert torch.equal(out.bool(), expected), (V, k, (out.bool() != expected).any(-1).nonzero().tolist())


def test_sampling_distribution(monkeypatch):
    """Drawn frequencies follow the top-k/temperature distribution (on the twin, which the kernel equals)."""
    B, V = 4000, 64
    params = [SamplingParams(temperature=0.5, top_k=3, seed=s) for s in range(B)]
    p = SamplerTensors.build(params, False, DEVICE)
    logits = torch.linspace(0, 2, V, device=DEVICE).expand(B, V).contiguous()
    ids = _twin(monkeypatch, sample_tokens, logits, p, torch.arange(B, device=DEVICE),
                torch.zeros(B, dtype=torch.long, device=DEVICE))
    expected = (logits[0, -3:] / 0.5).softmax(-1)
    freq = torch.bincount(ids, minlength=V).float() / B
    assert freq[:-3].sum() == 0
    assert torch.allclose(freq[-3:], expected, atol=0.03)


def _snake(C, g):
    return codec_kernels.snake_params(0.2 * torch.randn(C, device=DEVICE, generator=g),
                                      torch.randn(C, device=DEVICE, generator=g))


def _check_act(act, ref_act, context, dtype):
    """act = [the consumer's kept context, SnakeBeta(y)]: the context copied exactly, the rest close."""
    L = 0 if context is None else context.shape[1]
    assert act.shape == ref_act.shape
    if L:
        assert torch.equal(act[:, :L], context) and torch.equal(ref_act[:, :L], context)
    _close(act[:, L:], ref_act[:, L:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,dilation,T,residual,snake,keep_out,context", [
    (7, 9, 5, False, True, False, 0),     # fewer new steps than the kept context
    (7, 3, 40, False, False, True, 0),    # more
    (1, 1, 33, True, True, True, 18),     # the residual unit's second conv: no state, residual, both outputs,
                                          # its activation written behind the next convolution's context
    (3, 1, 2, False, True, True, 6),
])
def test_causal_conv(monkeypatch, dtype, k, dilation, T, residual, snake, keep_out, context):
    g = torch.Generator(DEVICE).manual_seed(3)
    B, C_in, C_out, L = 3, 40, 24, (k - 1) * dilation
    x = torch.randn(B, T, C_in, device=DEVICE, generator=g).to(dtype)
    w = (0.2 * torch.randn(k, C_in, C_out, device=DEVICE, generator=g)).to(dtype)
    bias = torch.randn(C_out, device=DEVICE, generator=g).to(dtype)
    state = torch.randn(B, L, C_in, device=DEVICE, generator=g).to(dtype) if L else None
    res = torch.randn(B, T, C_out, device=DEVICE, generator=g).to(dtype) if residual else None
    params = _snake(C_out, g) if snake else None
    ctx = torch.randn(B, context, C_out, device=DEVICE, generator=g).to(dtype) if context else None
    kwargs = dict(residual=res, snake=params, keep_out=keep_out, act_context=ctx)
    xp = x if state is None else torch.cat([state, x], dim=1)  # the kept context in front of the new steps
    ref_state = None if state is None else state.clone()
    out, act = codec_kernels.causal_conv(xp, state, w, bias, dilation, **kwargs)
    ref_out, ref_act = _twin(monkeypatch, codec_kernels.causal_conv, xp, ref_state, w, bias, dilation, **kwargs)
    assert (out is None) == (ref_out is None) == (not keep_out)
    if keep_out:
        _close(out, ref_out, dtype)
    assert (act is None) == (ref_act is None) == (not snake)
    if snake:
        _check_act(act, ref_act, ctx, dtype)
    if state is not None:  # the last L steps of [state, x]
        assert torch.equal(state, ref_state)
        assert torch.equal(state[:, -min(T, L):], x[:, -min(T, L):])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C,dilation,T,keep_out,context", [
    (24, 9, 5, True, 18),    # fewer new steps than the kept context; C not a power of two
    (40, 3, 37, False, 0),   # more; rows not a multiple of the tile; the last unit (no y kept)
    (96, 1, 70, True, 54),   # the codec's last stage: several pointwise column tiles
    (4, 1, 9, True, 6),      # fewer channels than the smallest matrix-product tile (the tiny codec's)
])
def test_residual_unit(monkeypatch, dtype, C, dilation, T, keep_out, context):
    g = torch.Generator(DEVICE).manual_seed(5)
    B, L = 3, 6 * dilation
    x = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype)
    w1 = (torch.randn(7, C, C, device=DEVICE, generator=g) / (7 * C) ** 0.5).to(dtype)
    w2 = (torch.randn(1, C, C, device=DEVICE, generator=g) / C ** 0.5).to(dtype)
    b1, b2 = (torch.randn(C, device=DEVICE, generator=g).to(dtype) for _ in range(2))
    state = torch.randn(B, L, C, device=DEVICE, generator=g).to(dtype)
    res = torch.randn(B, T, C, device=DEVICE, generator=g).to(dtype)
    mid, after = _snake(C, g), _snake(C, g)
    ctx = torch.randn(B, context, C, device=DEVICE, generator=g).to(dtype) if context else None
    assert codec_kernels.unit_config(B * T, C) is not None  # the fused kernel runs, not the two-call fallback
    xp, ref_state = torch.cat([state, x], dim=1), state.clone()
    out, act = codec_kernels.residual_unit(xp, state, w1, b1, mid, w2, b2, res, after, dilation, keep_out, ctx)
    ref_out, ref_act = _twin(monkeypatch, codec_kernels.residual_unit, xp, ref_state, w1, b1, mid, w2, b2, res, after,
                             dilation, keep_out, ctx)
    assert (out is None) == (ref_out is None) == (not keep_out)
    if keep_out:
        _close(out, ref_out, dtype)
    _check_act(act, ref_act, ctx, dtype)
    assert torch.equal(state, ref_state) and torch.equal(state, xp[:, -L:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context", [0, 6])
def test_conv_transpose(monkeypatch, dtype, context):
    g = torch.Generator(DEVICE).manual_seed(4)
    B, T, C_in, C_out, s = 2, 5, 32, 20, 3
    x = torch.randn(B, T, C_in, device=DEVICE, generator=g).to(dtype)
    w = (0.2 * torch.randn(C_in, 2 * s * C_out, device=DEVICE, generator=g)).to(dtype)
    bias = torch.randn(C_out, device=DEVICE, generator=g).to(dtype)
    tail = torch.randn(B, s, C_out, device=DEVICE, generator=g).to(dtype)
    params, ref_tail = _snake(C_out, g), tail.clone()
    ctx = torch.randn(B, context, C_out, device=DEVICE, generator=g).to(dtype) if context else None
    out, act = codec_kernels.conv_transpose(x, tail, w, bias, s, params, ctx)
    ref_out, ref_act = _twin(monkeypatch, codec_kernels.conv_transpose, x, ref_tail, w, bias, s, params, ctx)
    _close(out, ref_out, dtype)
    _check_act(act, ref_act, ctx, dtype)
    assert torch.equal(tail, ref_tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv", [(4, 4), (4, 2)])
def test_ring_attention_step(monkeypatch, dtype, num_heads, num_kv):
    g = torch.Generator(DEVICE).manual_seed(6)
    B, W, D = 4, 7, 16
    positions = torch.tensor([0, 3, 6, 40], device=DEVICE)  # a fresh stream, part-filled, just full, wrapped
    qkv = torch.randn(B, (num_heads + 2 * num_kv) * D, device=DEVICE, generator=g).to(dtype)
    k_ring = torch.randn(B, num_kv, W, D, device=DEVICE, generator=g).to(dtype)
    v_ring = torch.randn(B, num_kv, W, D, device=DEVICE, generator=g).to(dtype)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=DEVICE).float() / D)
    rings = (k_ring.clone(), v_ring.clone())
    out = codec_kernels.ring_attention_step(qkv, positions, k_ring, v_ring, inv_freq, num_heads, None)
    ref = _twin(monkeypatch, codec_kernels.ring_attention_step, qkv, positions, *rings, inv_freq, num_heads, None)
    _close(out, ref, dtype)
    for ring, ref_ring in zip((k_ring, v_ring), rings):
        _close(ring, ref_ring, dtype)
    # only each row's slot (position % W) was written
    slot = positions % W
    for b in range(B):
        others = torch.arange(W, device=DEVICE) != slot[b]
        assert torch.equal(k_ring[b][:, others], rings[0][b][:, others])


def test_noise_stays_strictly_inside_the_unit_interval():
    """The largest hash value must not round to u = 1.0 (an exponential of 0 would let a removed token win)."""
    from q3tts.sampling import uniform_noise

    u = uniform_noise(torch.arange(64, device=DEVICE), torch.arange(64, device=DEVICE), 4096)
    assert float(u.max()) < 1.0 and float(u.min()) > 0.0
    top = ((torch.tensor([(1 << 32) - 1]) >> 9).float() + 0.5) / float(1 << 23)
    assert float(top) < 1.0


@pytest.mark.parametrize("trial", [(0, 1), (2, 3)])  # (the noise counters of a test: two trials each)
def test_removed_tokens_never_drawn(monkeypatch, trial):
    """Even with noise at its extremes, a token whose probability is 0 (suppressed, outside top-k) is never
    drawn."""
    B, V = 16, 3072
    params = SamplerTensors.build([SamplingParams(temperature=1.0, top_k=5, seed=s) for s in range(B)], False,
                                  DEVICE)
    logits = torch.randn(B, V, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    for counter in trial:
        counters = torch.full((B,), counter, device=DEVICE)
        ids = sample_tokens(logits, params, torch.arange(B, device=DEVICE), counters)
        top5 = logits.topk(5, dim=-1).indices
        assert bool((top5 == ids[:, None]).any(-1).all())


@pytest.mark.parametrize("fused", [False, True])
def test_a_decoder_step_with_the_fused_attention(monkeypatch, tmp_path, fused):
    """One decode step of the tiny talker (rows at different positions, one crossing a block) with the fused
    attention kernel (and with `fused`, the fused products too) equals the step with the unfused kernels:
    hidden states and the caches."""
    from q3tts import TTS
    from q3tts.engine.runner.transformer import FlatDecoder, PagedCache
    from q3tts.tiny import tiny_checkpoint

    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device=DEVICE, dtype=torch.float32)
    talker, tc = tts.model.talker, tts.config.talker_config
    decoder = FlatDecoder(talker.model.layers, talker.model.norm.weight, tc.rms_norm_eps, tc.num_attention_heads,
                          tc.head_dim, talker.model.inv_freq)
    history = [5, 17, 0]
    caches = []
    for _ in range(2):
        cache = PagedCache.allocate(tc.num_hidden_layers, 8, 16, tc.num_key_value_heads, tc.head_dim, 4, 2,
                                    torch.float32, torch.device(DEVICE))
        cache.block_table.copy_(torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]], dtype=torch.int32))
        caches.append(cache)
    g = torch.Generator(DEVICE).manual_seed(0)
    rows, positions, step_rows, step_positions = _history_tokens(history)
    past = torch.randn(len(rows), tc.hidden_size, generator=g, device=DEVICE)
    x = torch.randn(len(history), tc.hidden_size, generator=g, device=DEVICE)
    outs = []
    with torch.no_grad():
        for cache, decode in zip(caches, (False, True)):
            _twin(monkeypatch, decoder, past, rows, positions, cache)  # the same history in both
            outs.append(decoder(x, step_rows, step_positions, cache, decode=decode, fused=fused and decode))
    _close(outs[1], outs[0], torch.float32)
    _close(caches[1].k, caches[0].k, torch.float32)  # (layer 2 on: from hidden states equal to rounding)
    _close(caches[1].v, caches[0].v, torch.float32)


@pytest.mark.parametrize("case", ["decode_1", "decode_2", "decode_5", "first_pass", "first_pass_3"])
def test_the_fused_products_equal_the_unfused_decoder(monkeypatch, tmp_path, case):
    """A call on the fused products (the matrix-vector kernel for a token or two, the tensor-core kernel with the
    sums of squares handed on for more, the norms, SwiGLU and residual adds inside) equals the unfused decoder:
    one, two or five streams' decode step (one crossing a block), and a code predictor's first pass (two new tokens
    of each row, attention through the prefill kernels) for one stream and three; hidden states and caches. With
    final_norm=False the residual stream and its sums of squares come back, and the final norm of it is the
    output."""
    from q3tts import TTS
    from q3tts.engine.runner.transformer import FlatDecoder, PagedCache
    from q3tts.tiny import tiny_checkpoint

    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device=DEVICE, dtype=torch.float32)
    cp, cc = tts.model.talker.code_predictor, tts.config.talker_config.code_predictor_config
    decoder = FlatDecoder(cp.model.layers, cp.model.norm.weight, cc.rms_norm_eps, cc.num_attention_heads,
                          cc.head_dim, cp.model.inv_freq)
    history, rows, positions = {"decode_1": ([4], [0], [4]), "decode_2": ([4, 9], [0, 1], [4, 9]),
                                "decode_5": ([4, 9, 0, 16, 2], [0, 1, 2, 3, 4], [4, 9, 0, 16, 2]),
                                "first_pass": ([0], [0, 0], [0, 1]),
                                "first_pass_3": ([0] * 3, [0, 0, 1, 1, 2, 2], [0, 1] * 3)}[case]
    g = torch.Generator(DEVICE).manual_seed(1)
    past_rows = torch.tensor([r for r, n in enumerate(history) for _ in range(n)], dtype=torch.int32, device=DEVICE)
    past_positions = torch.tensor([i for n in history for i in range(n)], dtype=torch.int32, device=DEVICE)
    past = torch.randn(len(past_rows), cc.hidden_size, generator=g, device=DEVICE)
    x = torch.randn(len(rows), cc.hidden_size, generator=g, device=DEVICE)
    rows = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    decode = not case.startswith("first_pass")  # (a decode step's tokens are one per row)
    assert decoder.fuses(len(rows), True) and not decoder.fuses(len(rows), False)
    outs, caches = [], []
    with torch.no_grad():
        for fused in (False, True):
            n = len(history)  # (row r: blocks r + 1 and n + r + 1)
            cache = PagedCache.allocate(cc.num_hidden_layers, 2 * n + 1, 16, cc.num_key_value_heads, cc.head_dim, n,
                                        2, torch.float32, torch.device(DEVICE))
            cache.block_table.copy_(torch.arange(1, 2 * n + 1, dtype=torch.int32).view(2, n).t())
            if len(past_rows):
                _twin(monkeypatch, decoder, past, past_rows, past_positions, cache)  # the same history in both
            outs.append(decoder(x, rows, positions, cache, decode=decode, fused=fused))
            caches.append(cache)
        residual, squares = decoder(x, rows, positions, caches[1], decode=decode, fused=True, final_norm=False)
    assert residual.dtype == torch.float32
    if len(rows) <= linear.GEMV_MAX_ROWS:  # (the matrix-vector kernel norms its rows itself)
        assert squares is None
    else:
        torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)
    _close(outs[1], outs[0], torch.float32)
    _close(norm.add_rmsnorm(residual, None, decoder.final_norm, decoder.eps, torch.float32)[0], outs[0],
           torch.float32)
    _close(caches[1].k, caches[0].k, torch.float32)
    _close(caches[1].v, caches[0].v, torch.float32)
    with pytest.raises(ValueError, match="final_norm"):
        decoder(x, rows, positions, caches[0], decode=decode, fused=False, final_norm=False)


def test_which_calls_take_the_fused_products():
    """Up to FUSED_MAX_ROWS tokens but a decoder's `unfused_rows` (the 1.7B talker's two rows); nothing without
    `fused`."""
    from q3tts.engine.runner.transformer import FUSED_MAX_ROWS, FlatDecoder

    args = ([], torch.ones(8), 1e-6, 2, 4, torch.ones(2))
    default, wide = FlatDecoder(*args), FlatDecoder(*args, unfused_rows=(2,))
    assert [n for n in range(1, 40) if default.fuses(n, True)] == list(range(1, FUSED_MAX_ROWS + 1))
    assert [n for n in range(1, 40) if wide.fuses(n, True)] == [1, *range(3, FUSED_MAX_ROWS + 1)]
    assert not default.fuses(1, False)


@pytest.mark.slow(reason="whole frames in the Triton interpreter (tests/SLOW.md)")
@pytest.mark.parametrize("part", ["teacher_forced", "engine"])  # (a test each: the interpreter takes a while)
@pytest.mark.parametrize("kind", ["tiny", "tiny-custom-voice-0.6b"])
def test_the_runner_on_the_fused_products(monkeypatch, tmp_path, kind, part):
    """The frame on the fused products (one or two streams; fp32 here, where the runner keeps them off, so that
    the interpreter can run them and the reference is exact): the code predictor's first pass and steps and the
    heads with the final norm inside their products, ("tiny": a code predictor narrower than the talker) its
    inputs looked up projected, its steps' first qkv products looked up, and its first pass's attention in pairs
    (pair_attention), give the reference model's
    teacher-forced logits (part "teacher_forced"), and the codes of two streams are the reference loop's ("engine")."""
    from q3tts import TTS
    from q3tts.engine import EngineConfig
    from q3tts.engine.runner import frame as frame_step
    from q3tts.engine.runner import transformer as decoder
    from q3tts.engine.runner.model_runner import ModelRunner
    from q3tts.reference import generate_codes
    from q3tts.request.prompt import build_prompt
    from q3tts.teacher_forcing import teacher_forced_logits
    from q3tts.tiny import tiny_checkpoint
    from tests.engine.test_model_runner import run_engine

    tts = TTS.from_pretrained(tiny_checkpoint(kind, tmp_path), device=DEVICE, dtype=torch.float32)
    talker = tts.model.talker
    specs = [tts.request(text, speaker="ryan", language="english").spec for text in ("Hello there.", "Thank you.")]
    prompts = [build_prompt(talker, tts.config, spec) for spec in specs]
    params = [SamplingParams(do_sample=False, subtalker_dosample=False, max_new_tokens=4, seed=1),
              SamplingParams(max_new_tokens=3, seed=4)]
    reference = generate_codes(talker, prompts, params)
    runner = ModelRunner(tts.model, EngineConfig(max_rows=2, max_context=128, block_size=16, max_trailing=64))
    runner.decode_modes = {"decode": True, "fused": True}
    runner.cp_input_tables = runner.prepare_cp_input_tables()
    assert (runner.cp_input_tables is not None) == (kind == "tiny")
    runner.cp_qkv_tables = runner.prepare_cp_qkv_tables()
    if DEVICE == "cpu":  # one program per product (the interpreter runs programs one by one)
        monkeypatch.setattr(linear, "_gemv_tiles", lambda N, K, swiglu, rows: (triton.next_power_of_2(N),
                                                                                triton.next_power_of_2(K), 4, 1))
    calls, fused_linear = [], linear.fused_linear
    for module in (frame_step, decoder):
        monkeypatch.setattr(module, "fused_linear", lambda *a, **k: calls.append((a, k)) or fused_linear(*a, **k))
    pairs = []
    monkeypatch.setattr(decoder, "pair_attention", lambda *a, **k: pairs.append(1) or attention.pair_attention(*a, **k))
    if part == "engine":
        for a, b in zip(run_engine(runner, prompts, params), reference):
            assert torch.equal(a, b)
        assert calls and pairs  # (the engine's frames ran on the fused products)
        return
    ours = runner.teacher_forced_logits(prompts[0], reference[0])
    for a, b in zip(ours, teacher_forced_logits(talker, prompts[0], reference[0])):
        assert a.shape == b.shape and float((a - b).abs().max() / b.abs().max()) < 1e-5
    assert any(k.get("fp32_out") and k.get("norm") is not None for _, k in calls)  # the heads norm their input
    # the code predictor's first qkv product runs in each frame's first pass only: its steps look theirs up
    assert sum(a[1] is runner.cp.layers[0].qkv for a, _ in calls) == len(reference[0])
    assert len(pairs) == len(reference[0]) * len(runner.cp.layers)  # (the first passes' attention)


def test_frame_sum_adds_in_order():
    """The frame embedding's fp32 sum (3 kernels on CUDA) equals adding the 16 embeddings one by one, bit for
    bit; magnitudes spread so that another order would round differently."""
    from q3tts.engine.runner.frame import frame_sum

    g = torch.Generator(DEVICE).manual_seed(3)
    dtype = DTYPES[-1]
    embeds = [(torch.randn(4, 256, device=DEVICE, generator=g) * 10.0 ** (i % 5 - 2)).to(dtype) for i in range(16)]
    expected = embeds[0].float()
    for e in embeds[1:]:
        expected = expected + e.float()
    assert torch.equal(frame_sum(torch.stack(embeds)), expected)
    backwards = embeds[-1].float()
    for e in embeds[-2::-1]:
        backwards = backwards + e.float()
    assert not torch.equal(backwards, expected)  # the order shows in the bits


def _layer_weights(device: str, hidden: int = 1024, inter: int = 3072, empty: bool = False):
    """A decoder layer's fused weights (16 + 2 x 8 heads of 128), bf16: hidden 1,024 and a 3,072-wide MLP are the
    code predictors' (and the 0.6B talker's) shapes, 2,048 and 6,144 the 1.7B talker's; random, or with `empty`
    uninitialized (for what needs the shapes alone)."""
    from q3tts.layers.attention import FusedLayerWeights

    g = torch.Generator("cpu").manual_seed(7)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device, torch.bfloat16)
    norm = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(device, torch.bfloat16)
    if empty:
        rand = norm = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device=device)
    return FusedLayerWeights(qkv=rand(4096, hidden), o=rand(hidden, 2048), gate_up=rand(2 * inter, hidden),
                             down=rand(hidden, inter), input_norm=norm(hidden), post_norm=norm(hidden),
                             q_norm=norm(128), k_norm=norm(128))


def _history_tokens(history: list[int]) -> tuple[torch.Tensor, ...]:
    """Rows with history[r] earlier positions each: (rows, positions) of every earlier token, then (rows,
    positions) of each row's next one, on DEVICE."""
    as_ints = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)
    return (as_ints([r for r, n in enumerate(history) for _ in range(n)]),
            as_ints([i for n in history for i in range(n)]), as_ints(list(range(len(history)))), as_ints(history))


def _bf16_cache(layers: int, rows: int, blocks_per_row: int):
    """A bf16 PagedCache (8 KV heads of 128, blocks of 16) whose row r holds blocks r * blocks_per_row + 1, ..."""
    from q3tts.engine.runner.transformer import PagedCache

    cache = PagedCache.allocate(layers, rows * blocks_per_row + 1, 16, 8, 128, rows, blocks_per_row, torch.bfloat16,
                                torch.device(DEVICE))
    cache.block_table.copy_(torch.arange(1, rows * blocks_per_row + 1, dtype=torch.int32).view(rows, blocks_per_row))
    return cache


def _random_decoder(layers: int, hidden: int, inter: int):
    """A FlatDecoder of `layers` random bf16 layers (_layer_weights) with 16 query heads of 128 on DEVICE."""
    from q3tts.engine.runner.transformer import FlatDecoder

    decoder = FlatDecoder([], torch.ones(hidden, device=DEVICE, dtype=torch.bfloat16), 1e-6, 16, 128,
                          1.0 / 10000 ** (torch.arange(0, 128, 2, device=DEVICE).float() / 128))
    decoder.layers = [_layer_weights(DEVICE, hidden, inter) for _ in range(layers)]
    return decoder


@pytest.mark.slow(reason="16 compilations of the Gluon kernel (tests/SLOW.md)")
def test_the_persistent_layer_tail_compiles_for_hopper():
    """The Gluon kernel (Hopper only, no interpreter) compiles for sm_90 at the code predictor's and the 1.7B talker's
    shapes, at 64 and 128 rows, with the next layer's qkv product, the head's (fp32 logits) or neither, with and
    without PDL, the residual stream coming in as fp32 or as the bf16 input rows (the code predictor's looked-up
    first layer), within a program's shared memory; what it computes is checked on a GPU (below). In a process of
    its own: this one's Triton interprets (conftest)."""
    import subprocess
    import sys
    from pathlib import Path

    from q3tts.kernels import persistent

    if persistent.gluon is None:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", "from tests.kernels.test_kernels import compile_tail; compile_tail()"],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def _barriers_held(tail) -> bool:
    """No barrier of the tail's launches gave up, and each was passed by every program (the count a multiple of
    them)."""
    count, error = tail.sync.tolist()
    return error == 0 and count > 0 and count % tail.programs == 0


def compile_tail() -> None:
    from q3tts.kernels import persistent

    for (hidden, inter), rows in itertools.product(((1024, 3072), (2048, 6144)), persistent.ROWS):
        _compile_tail(hidden, inter, rows)


def _compile_tail(hidden: int, inter: int, rows: int) -> None:
    from q3tts.kernels import persistent

    # (compiling needs the shapes alone: empty weights, where random ones took most of the test's time)
    w, after = _layer_weights("cpu", hidden, inter, empty=True), _layer_weights("cpu", hidden, inter, empty=True)
    attended, res = torch.zeros(rows, 2048, dtype=torch.bfloat16), torch.zeros(rows, hidden)
    head = torch.zeros(2048, hidden, dtype=torch.bfloat16)
    for next_w, res_in, pdl, last in ((after, res, True, None), (None, res, False, None),
                                      (after, res.bfloat16(), True, None), (None, res, True, head)):
        args, consts, out = persistent.arguments(attended, res_in, res, w, next_w, after.input_norm, 1e-6,
                                                 torch.zeros(2, dtype=torch.int64), 132, pdl=pdl, head=last)
        assert out.shape == ((rows, 4096) if next_w is not None else (rows, 2048) if last is not None
                             else (rows, hidden))
        kernel = persistent.compile_for_hopper(persistent.tail_kernel, args, consts)
        assert kernel.metadata.shared <= persistent.shared_bytes(rows) <= persistent.SHARED_BYTES


@pytest.mark.skipif(DEVICE == "cpu", reason="Hopper only (its compilation is checked on the CPU above)")
@pytest.mark.parametrize("layers, hidden, inter, n", [(5, 1024, 3072, 64), (28, 1024, 3072, 64),
                                                     (28, 2048, 6144, 64), (5, 1024, 3072, 128)])
def test_the_persistent_layer_tail_equals_the_kernels_per_step(monkeypatch, layers, hidden, inter, n):
    """A decode step of n rows (64; 128 for the decoders 1,024 wide) of a decoder at the code predictor's shapes (5
    layers; 28: the 0.6B talker's) and the 1.7B talker's, every row with its own history: with the rest of each
    layer in one launch it gives the hidden states and caches of the kernels per step, within bf16, also with the
    first layer's qkv product given and the input rows in bf16 (the code predictor's steps); the barriers never
    gave up."""
    import torch.nn.functional as F

    from q3tts.kernels import persistent

    # (values that bf16 holds exactly: the step with its input in bf16 starts from the same stream)
    x = torch.randn(n, hidden, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0)).bfloat16().float()
    if not persistent.applies(x, torch.bfloat16, hidden, 2048, 4096, inter):
        pytest.skip("not a Hopper GPU")
    decoder = _random_decoder(layers, hidden, inter)
    g = torch.Generator(DEVICE).manual_seed(1)
    history = [(r * 7) % 40 for r in range(n)]  # 0-39 earlier positions per row, blocks of 16
    rows, positions, step_rows, step_positions = _history_tokens(history)
    past = torch.randn(len(rows), hidden, generator=g, device=DEVICE)
    outs, caches = [], []
    first = decoder.layers[0]
    with torch.no_grad():
        qkv0 = F.linear(norm.add_rmsnorm(x, None, first.input_norm, 1e-6, torch.bfloat16)[0], first.qkv)
        for enabled, looked_up in ((False, False), (True, False), (True, True)):
            monkeypatch.setattr(persistent, "ENABLED", enabled)
            cache = _bf16_cache(layers, n, 3)
            decoder(past, rows, positions, cache)  # the same history in each (the prefill kernels)
            step_x, step_qkv0 = (x.bfloat16(), qkv0) if looked_up else (x, None)
            outs.append(decoder(step_x, step_rows, step_positions, cache, decode=True, qkv0=step_qkv0))
            caches.append(cache)
    assert decoder.tail is not None and _barriers_held(decoder.tail)
    for out, cache in zip(outs[1:], caches[1:]):
        _close(out, outs[0], torch.bfloat16)
        _close_chained(cache.k, caches[0].k, layers)
        _close_chained(cache.v, caches[0].v, layers)
    assert torch.equal(outs[2], outs[1])  # (the same products: the looked-up qkv is the one computed)


@pytest.mark.skipif(DEVICE == "cpu", reason="Hopper only (its compilation is checked on the CPU above)")
def test_a_head_on_the_persistent_layer_tail_gives_the_steps_logits():
    """A decode step of 64 rows of the code predictor's shapes with a head [2,048, 1,024] as its last launch's last
    phase: the logits (fp32) of the step's output through the head, within fp32 sums in another order; the step's
    caches as without the head."""
    from q3tts.kernels import persistent

    n = 64
    x = torch.randn(n, 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    if not persistent.applies(x, torch.bfloat16, 1024, 2048, 4096, 3072):
        pytest.skip("not a Hopper GPU")
    decoder = _random_decoder(5, 1024, 3072)
    head = (torch.randn(2048, 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1)) / 32).bfloat16()
    rows, positions, step_rows, step_positions = _history_tokens([(r * 7) % 40 for r in range(n)])
    past = torch.randn(len(rows), 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    caches = [_bf16_cache(5, n, 3) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            decoder(past, rows, positions, cache)
        hidden = decoder(x, step_rows, step_positions, caches[0], decode=True)
        logits = decoder.decode_logits(x, step_rows, step_positions, caches[1], head)
    assert logits is not None and logits.dtype == torch.float32 and logits.shape == (n, 2048)
    torch.testing.assert_close(logits, hidden.float() @ head.float().t(), rtol=1e-4, atol=1e-4)
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)
    assert _barriers_held(decoder.tail)


@pytest.mark.skipif(DEVICE == "cpu", reason="Hopper only (its compilation is checked on the CPU above)")
def test_the_persistent_layer_tail_under_pdl_in_a_graph_equals_it_without(monkeypatch):
    """PDL lets each launch start while the attention before it finishes, and the attention after it start early:
    replayed in a CUDA graph (as the engine runs it), a 64-row decode step gives bit for bit what it gives without
    PDL, launch by launch."""
    from q3tts.kernels import persistent

    x = torch.randn(64, 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    if not persistent.applies(x, torch.bfloat16, 1024, 2048, 4096, 3072) or not backend.pdl_flags(x, True)["PDL"]:
        pytest.skip("not a Hopper GPU, or no PDL in this Triton")
    decoder = _random_decoder(5, 1024, 3072)
    rows, positions, step_rows, step_positions = _history_tokens([(r * 7) % 40 for r in range(64)])
    cache = _bf16_cache(5, 64, 3)
    with torch.no_grad():
        decoder(torch.randn(len(rows), 1024, device=DEVICE), rows, positions, cache)
        monkeypatch.setattr(persistent, "PDL", False)
        expected = decoder(x, step_rows, step_positions, cache, decode=True)
        monkeypatch.setattr(persistent, "PDL", True)
        decoder(x, step_rows, step_positions, cache, decode=True)  # (compiles the PDL variants before the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decoder(x, step_rows, step_positions, cache, decode=True)
        for _ in range(3):
            out.zero_()
            graph.replay()
            assert torch.equal(out, expected)
    assert _barriers_held(decoder.tail)


@pytest.mark.skipif(DEVICE == "cpu", reason="Hopper only (its compilation is checked on the CPU above)")
@pytest.mark.parametrize("tokens", [64, 128])
def test_a_first_pass_in_pairs_on_the_persistent_tail_equals_the_kernels_per_step(monkeypatch, tokens):
    """The code predictor's first pass (each row's positions 0 and 1, in pairs) of 32 or 64 rows, 64 or 128 tokens:
    with the rest of each layer in one launch it gives the hidden states and caches of the kernels per step."""
    from q3tts.kernels import persistent

    x = torch.randn(tokens, 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(0))
    if not persistent.applies(x, torch.bfloat16, 1024, 2048, 4096, 3072, first_pass=True):
        pytest.skip("not a Hopper GPU")
    decoder = _random_decoder(5, 1024, 3072)
    rows = torch.arange(tokens // 2, dtype=torch.int32, device=DEVICE).repeat_interleave(2)
    positions = torch.tensor([0, 1] * (tokens // 2), dtype=torch.int32, device=DEVICE)
    outs, caches = [], []
    with torch.no_grad():
        for enabled in (False, True):
            monkeypatch.setattr(persistent, "ENABLED", enabled)
            cache = _bf16_cache(5, tokens // 2, 1)
            outs.append(decoder(x, rows, positions, cache, pairs=True))
            caches.append(cache)
    assert decoder.tail is not None and _barriers_held(decoder.tail)
    _close(outs[1], outs[0], torch.bfloat16)
    _close(caches[1].k, caches[0].k, torch.bfloat16)
    _close(caches[1].v, caches[0].v, torch.bfloat16)


def test_a_persistent_kernel_that_does_not_launch_leaves_the_kernels_per_step(monkeypatch, tmp_path, caplog):
    """If the layer tail's first launch fails (a GPU shared under MPS cannot hold a cooperative launch of every SM,
    say), the decoder says so once and serves that step and the later ones with its kernels per step, with their
    results."""
    from q3tts import TTS
    from q3tts.engine.runner.transformer import FlatDecoder, PagedCache
    from q3tts.kernels import persistent
    from q3tts.tiny import tiny_checkpoint

    if DEVICE == "cpu":  # (the PyTorch twins: the interpreter is slow at 64 rows, and the kernels are not the point)
        monkeypatch.setattr(backend, "USE_TWINS", True)
    tts = TTS.from_pretrained(tiny_checkpoint("tiny", tmp_path), device=DEVICE, dtype=torch.float32)
    talker, tc = tts.model.talker, tts.config.talker_config
    decoder = FlatDecoder(talker.model.layers, talker.model.norm.weight, tc.rms_norm_eps, tc.num_attention_heads,
                          tc.head_dim, talker.model.inv_freq)
    g = torch.Generator(DEVICE).manual_seed(0)
    x = torch.randn(64, tc.hidden_size, generator=g, device=DEVICE)
    rows = torch.arange(64, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(64, dtype=torch.int32, device=DEVICE)

    def step():
        cache = PagedCache.allocate(tc.num_hidden_layers, 65, 16, tc.num_key_value_heads, tc.head_dim, 64, 1,
                                    torch.float32, torch.device(DEVICE))
        cache.block_table.copy_(torch.arange(1, 65, dtype=torch.int32).view(64, 1))
        with torch.no_grad():
            return decoder(x, rows, positions, cache, decode=True)

    expected = step()  # (the kernels per step: this decoder's shapes are not the kernel's)
    launches = []

    class Refused:
        def __init__(self, device):
            pass

        def __call__(self, *args, **kwargs):
            launches.append(1)
            raise RuntimeError("too many blocks in cooperative launch")

    monkeypatch.setattr(persistent, "applies", lambda *args: True)
    monkeypatch.setattr(persistent, "LayerTail", Refused)
    with caplog.at_level("WARNING", logger="q3tts.engine.runner.transformer"):
        assert torch.equal(step(), expected)
        assert torch.equal(step(), expected)
    assert launches == [1] and decoder.tail is False
    assert sum("did not launch" in r.getMessage() for r in caplog.records) == 1

"""The sampling kernel (top-k, top-p, the talker's processors, the noise) against its PyTorch twin and against
transformers' warpers at the edges (tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import backend  # noqa: E402
from q3tts.kernels.sampler import TalkerProcessors, sample_tokens  # noqa: E402
from q3tts.sampling import SamplerTensors, SamplingParams  # noqa: E402
from tests.kernels.twins import DEVICE, DTYPES, twin  # noqa: E402


def _params() -> list[SamplingParams]:
    rows = [dict(do_sample=False), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_k=0, top_p=0.8),
            dict(temperature=0.9, top_k=50, top_p=0.95), dict(temperature=1.0, top_k=1),
            dict(temperature=0.9, top_k=50), dict(temperature=2.0, top_k=3000, top_p=0.5),
            dict(temperature=1.0, top_k=0, top_p=1e-7)]  # (its tail's mass rounds to 1 - top_p: the largest kept)
    return [SamplingParams(**r, seed=100 + i) for i, r in enumerate(rows * 2)]  # (each setting, two seeds)


# (a trial a test: zero counters and offset, two nonzero ones, ties)
@pytest.mark.parametrize("trial", [0, 1, 2, 3])
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
    ref = twin(monkeypatch, sample_tokens, logits, p, seeds, counters + offset, twin_procs)
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
    assert torch.equal(ids, twin(monkeypatch, sample_tokens, logits, p, seeds, counters))
    assert torch.equal(ids, logits.argmax(-1))
    seen = torch.zeros(B, V, dtype=torch.bool, device=DEVICE)
    seen[:, :8] = True  # (a penalty of 1e-38 on positive logits: inf)
    logits[:, :8] = torch.arange(1, 9, device=DEVICE, dtype=torch.float32)
    procs = [TalkerProcessors(seen.clone(), torch.full((B,), 1e-38, device=DEVICE), torch.full((B,), 5, device=DEVICE),
                              torch.zeros(V, dtype=torch.bool, device=DEVICE), V - 1, 2) for _ in range(2)]
    p = SamplerTensors.build([SamplingParams(seed=i) for i in range(B)], False, DEVICE)
    ids = sample_tokens(logits, p, seeds, counters, procs[0])
    assert torch.equal(ids, twin(monkeypatch, sample_tokens, logits, p, seeds, counters, procs[1]))
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
    ids = twin(monkeypatch, sample_tokens, logits, p, torch.arange(B, device=DEVICE),
                torch.zeros(B, dtype=torch.long, device=DEVICE))
    expected = (logits[0, -3:] / 0.5).softmax(-1)
    freq = torch.bincount(ids, minlength=V).float() / B
    assert freq[:-3].sum() == 0
    assert torch.allclose(freq[-3:], expected, atol=0.03)


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

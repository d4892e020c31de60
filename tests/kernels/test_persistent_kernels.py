"""The persistent layer tail (Gluon, Hopper only): its compilation for sm_90 on the CPU, what it computes on the
GPU, and the kernels per step when it does not launch (tests/kernels/twins.py)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import backend, norm  # noqa: E402
from tests.kernels.twins import DEVICE, close, close_chained, history_tokens  # noqa: E402


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
    script = "from tests.kernels.test_persistent_kernels import compile_tail; compile_tail()"
    done = subprocess.run([sys.executable, "-c", script],
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
    rows, positions, step_rows, step_positions = history_tokens(history)
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
        close(out, outs[0], torch.bfloat16)
        close_chained(cache.k, caches[0].k, layers)
        close_chained(cache.v, caches[0].v, layers)
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
    rows, positions, step_rows, step_positions = history_tokens([(r * 7) % 40 for r in range(n)])
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
    rows, positions, step_rows, step_positions = history_tokens([(r * 7) % 40 for r in range(64)])
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
    close(outs[1], outs[0], torch.bfloat16)
    close(caches[1].k, caches[0].k, torch.bfloat16)
    close(caches[1].v, caches[0].v, torch.bfloat16)


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

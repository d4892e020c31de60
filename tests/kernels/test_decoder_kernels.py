"""A decoder call of the tiny models on the fused kernels (attention, products) against the unfused kernels, and
which calls take the fused products (tests/kernels/twins.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from q3tts.kernels import linear, norm  # noqa: E402
from tests.kernels.twins import DEVICE, close, history_tokens, twin  # noqa: E402


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
    rows, positions, step_rows, step_positions = history_tokens(history)
    past = torch.randn(len(rows), tc.hidden_size, generator=g, device=DEVICE)
    x = torch.randn(len(history), tc.hidden_size, generator=g, device=DEVICE)
    outs = []
    with torch.no_grad():
        for cache, decode in zip(caches, (False, True)):
            twin(monkeypatch, decoder, past, rows, positions, cache)  # the same history in both
            outs.append(decoder(x, step_rows, step_positions, cache, decode=decode, fused=fused and decode))
    close(outs[1], outs[0], torch.float32)
    close(caches[1].k, caches[0].k, torch.float32)  # (layer 2 on: from hidden states equal to rounding)
    close(caches[1].v, caches[0].v, torch.float32)


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
                twin(monkeypatch, decoder, past, past_rows, past_positions, cache)  # the same history in both
            outs.append(decoder(x, rows, positions, cache, decode=decode, fused=fused))
            caches.append(cache)
        residual, squares = decoder(x, rows, positions, caches[1], decode=decode, fused=True, final_norm=False)
    assert residual.dtype == torch.float32
    if len(rows) <= linear.GEMV_MAX_ROWS:  # (the matrix-vector kernel norms its rows itself)
        assert squares is None
    else:
        torch.testing.assert_close(squares.sum(0), residual.pow(2).sum(-1), rtol=1e-5, atol=0)
    close(outs[1], outs[0], torch.float32)
    close(norm.add_rmsnorm(residual, None, decoder.final_norm, decoder.eps, torch.float32)[0], outs[0],
           torch.float32)
    close(caches[1].k, caches[0].k, torch.float32)
    close(caches[1].v, caches[0].v, torch.float32)
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

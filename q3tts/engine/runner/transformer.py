"""A Qwen3 decoder stack over a flat list of tokens, on the fused kernels and a paged KV cache.

Serves the talker (prefill and decode) and the code predictor alike. Per layer: add+RMSNorm, one qkv matrix
product, q/k norm + RoPE + KV store, paged attention, o projection, add+RMSNorm, one gate/up product, SwiGLU,
down projection: 9 kernels. Decode calls in bf16/fp16 (`fused`: the streams' decode steps, their code predictor's
first pass) take 5 (6 beside the prefill's attention): the norms, SwiGLU and the residual adds move into the matrix
products (kernels.fused_linear), q/k norm, RoPE and the store into attention. Decode calls of 64 rows (and the code
predictor's first pass at 64 and 128 tokens) in bf16 on Hopper take 2: the attention, and the rest of the layer with
the next layer's qkv product as one persistent launch (persistent.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels import persistent
from ...kernels.activation import silu_mul
from ...kernels.attention import decode_attention, paged_attention, pair_attention, qk_norm_rope_store
from ...kernels.linear import GEMV_MAX_ROWS, fused_linear, row_squares
from ...kernels.norm import add_rmsnorm
from ...layers.attention import FusedLayerWeights, fuse_layer

log = logging.getLogger(__name__)

# Calls of up to GEMV_MAX_ROWS tokens take the matrix-vector kernel, calls of more, up to FUSED_MAX_ROWS (a decoder
# may leave some out, `unfused_rows`), the tensor-core kernel, each product handing the next norm its rows' sums
# of squares. Measured (docs/perf-notes.md, entries 41, 49, 51, 58 and 69; H100, 4-16 rows on an H200 in 58): the
# matrix-vector kernel took one row from 4.79 ms (1.7B frame, tensor-core kernel) to 4.00 and two rows from 5.06 /
# 4.31 ms (1.7B / 0.6B, cuBLAS) to 4.88 / 3.88, but the 1.7B talker's two rows (2,048 wide) from 1.77 to 1.95 ms;
# the tensor-core kernel with the sums handed on and the long products split over K beats cuBLAS and the separate
# norm and SwiGLU kernels at 3-16 rows (1.7B frame 4.87 -> 4.61 ms at 3 rows, 4.85 -> 4.63 at 16; 0.6B 4.24 ->
# 3.95, 4.11 -> 3.96), and lost at 64 rows (entries 58, 69: 1.7B 5.32 -> 5.69 ms, split or not).
FUSED_MAX_ROWS = 16


@dataclass
class PagedCache:
    """k, v: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]; block_table: [rows, blocks per row]."""

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_rows: int, blocks_per_row: int, dtype: torch.dtype, device: torch.device) -> PagedCache:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
                   block_table=torch.zeros(num_rows, blocks_per_row, dtype=torch.int32, device=device))


class FlatDecoder:
    """Runs `layers` (modules of the reference model, fused in place) over tokens at (rows, positions)."""

    def __init__(self, layers, final_norm: torch.Tensor, eps: float, num_heads: int, head_dim: int,
                 inv_freq: torch.Tensor, unfused_rows: tuple[int, ...] = ()):
        self.layers: list[FusedLayerWeights] = [fuse_layer(layer) for layer in layers]
        self.final_norm, self.eps = final_norm, eps
        self.num_heads, self.head_dim = num_heads, head_dim
        self.inv_freq = inv_freq.float()
        self.unfused_rows = unfused_rows
        # (built on the first call it serves; False once its first launch failed: the kernels per step serve)
        self.tail: persistent.LayerTail | bool | None = None

    def fuses(self, num_tokens: int, fused: bool = False) -> bool:
        """Whether a call over `num_tokens` tokens with `fused` takes the fused products: up to FUSED_MAX_ROWS tokens
        but `unfused_rows`, GEMV_MAX_ROWS of them on the matrix-vector kernel, more on the tensor-core kernel."""
        return fused and num_tokens <= FUSED_MAX_ROWS and num_tokens not in self.unfused_rows

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: PagedCache,
                 decode: bool = False, fused: bool = False, final_norm: bool = True,
                 qkv0: torch.Tensor | None = None,
                 pairs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x: [N, hidden] (any float dtype; the residual stream is fp32) -> normed hidden [N, hidden] in the
        weights' dtype. Writes each token's keys and values at its (row, position). `decode`: every token is the
        only new one of its row, so q/k norm, RoPE, the KV store and attention run as one kernel; `fused` (see
        `fuses`): the matrix products take their neighbours in too, and `final_norm` False returns (the residual
        stream (fp32) before the final norm, its rows' sums of squares or None) for a product that norms its input
        itself (fused_linear(norm=self.final_norm, squares=...)): one kernel fewer. `qkv0`: the first layer's input
        norm and qkv product of x [N, (Hq + 2 Hkv) D], looked up by the caller instead of computed here (the code
        predictor's decode inputs are embedding rows: runner.cp_qkv_tables). `pairs`: the tokens are their rows'
        first two positions, in pairs (the code predictor's first pass): their attention as one kernel."""
        if self.fuses(x.shape[0], fused):
            return self._fused(x, rows, positions, cache, decode, final_norm, qkv0, pairs)
        if not final_norm:
            raise ValueError("final_norm=False is for the fused products (see fuses)")
        if (decode or pairs) and self._tail_applies(x, pairs):
            out = self._with_tail(x, rows, positions, cache, qkv0, pairs)
            if out is not None:
                return out
        dtype = self.final_norm.dtype
        h, residual = x, None
        for i, w in enumerate(self.layers):
            if i == 0 and qkv0 is not None:
                residual, qkv = x, qkv0  # (the next add reads the stream as fp32)
            else:
                y, residual = add_rmsnorm(h, residual, w.input_norm, self.eps, dtype)
                qkv = F.linear(y, w.qkv)
            attended = self._attend(i, qkv, rows, positions, cache, decode, pairs=pairs)
            h = F.linear(attended, w.o)
            y, residual = add_rmsnorm(h, residual, w.post_norm, self.eps, dtype)
            h = F.linear(silu_mul(F.linear(y, w.gate_up)), w.down)
        return add_rmsnorm(h, residual, self.final_norm, self.eps, dtype)[0]

    def _tail_applies(self, x: torch.Tensor, first_pass: bool) -> bool:
        w = self.layers[0]
        return self.tail is not False and persistent.applies(x, w.qkv.dtype, w.o.shape[0], w.o.shape[1],
                                                             w.qkv.shape[0], w.down.shape[1], first_pass)

    def decode_logits(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: PagedCache,
                      head: torch.Tensor, qkv0: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode step's logits through `head` [V, hidden] in fp32, the head's product the last phase of the
        step's last launch on the layer tail (docs/perf-notes.md, entry 98); None where the tail does not take the
        step or the head there (persistent.HEAD_ROWS; the caller then runs the decoder and the head itself)."""
        if x.shape[0] not in persistent.HEAD_ROWS or not self._tail_applies(x, False):
            return None
        return self._with_tail(x, rows, positions, cache, qkv0, head=head)

    def _with_tail(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: PagedCache,
                   qkv0: torch.Tensor | None = None, pairs: bool = False,
                   head: torch.Tensor | None = None) -> torch.Tensor | None:
        """A decode step (or a first pass in pairs) on Hopper: per layer its attention, then the rest of the layer
        and the next layer's qkv product (the last: the final norm, and with `head` its logits) as one launch
        (persistent.LayerTail): 2 launches per layer instead of 8 (docs/perf-notes.md, entries 81, 92). None if
        the first launch fails (a GPU shared under MPS with fewer SMs than it reports cannot hold the cooperative
        launch, say): the decoder then keeps its kernels per step (they rewrite what the attempt stored)."""
        if self.tail is None:
            self.tail = persistent.LayerTail(x.device)
            try:
                return self._with_tail(x, rows, positions, cache, qkv0, pairs, head)
            except RuntimeError as e:
                log.warning("the persistent layer kernel did not launch (%s); the decoder keeps its kernels per step",
                            e)
                self.tail = False
                return None
        if qkv0 is None:
            y, res_in = add_rmsnorm(x, None, self.layers[0].input_norm, self.eps, self.final_norm.dtype)
            qkv = F.linear(y, self.layers[0].qkv)
        else:
            res_in, qkv = x, qkv0  # (the launch reads the stream as fp32)
        res = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for i, w in enumerate(self.layers):
            attended = self._attend(i, qkv, rows, positions, cache, decode=True, pdl=persistent.PDL, pairs=pairs)
            after = self.layers[i + 1] if i + 1 < len(self.layers) else None
            qkv = self.tail(attended, res_in if i == 0 else res, res, w, after,
                            after.input_norm if after is not None else self.final_norm, self.eps,
                            head=head if after is None else None)
        return qkv  # (after the last layer: the normed hidden states, or their logits)

    def _attend(self, i: int, qkv: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: PagedCache,
                decode: bool, pdl: bool = False, pairs: bool = False) -> torch.Tensor:
        """Layer i's q/k norm, RoPE, KV store and attention over qkv [N, (Hq + 2 Hkv) D] -> [N, Hq D]."""
        w, dtype = self.layers[i], self.final_norm.dtype
        if pairs:
            return pair_attention(qkv, w.q_norm, w.k_norm, self.eps, self.inv_freq, rows, positions, cache.block_table,
                                  cache.k[i], cache.v[i], self.num_heads, dtype)
        if decode:
            return decode_attention(qkv, w.q_norm, w.k_norm, self.eps, self.inv_freq, rows, positions,
                                    cache.block_table, cache.k[i], cache.v[i], self.num_heads, dtype, pdl=pdl)
        q = qk_norm_rope_store(qkv, w.q_norm, w.k_norm, self.eps, self.inv_freq, rows, positions, cache.block_table,
                               cache.k[i], cache.v[i], self.num_heads)
        return paged_attention(q, cache.k[i], cache.v[i], cache.block_table, rows, positions, dtype)

    def _fused(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: PagedCache,
               decode: bool, final_norm: bool, qkv0: torch.Tensor | None,
               pairs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        residual = x  # (read as fp32 by the first norm and residual add: no cast kernel for a bf16 input)
        pdl = x.shape[0] == 1  # (PDL pays at one token and costs at two: docs/perf-notes.md, entries 51-52)
        squares = row_squares(x) if x.shape[0] > GEMV_MAX_ROWS and qkv0 is None else None  # (see fused_linear)
        for i, w in enumerate(self.layers):
            if i == 0 and qkv0 is not None:
                qkv = qkv0
            else:
                qkv = fused_linear(residual, w.qkv, norm=w.input_norm, eps=self.eps, squares=squares, pdl=pdl)
            attended = self._attend(i, qkv, rows, positions, cache, decode, pdl=pdl, pairs=pairs)
            residual, squares = fused_linear(attended, w.o, residual=residual, squares_out=True, pdl=pdl)
            act = fused_linear(residual, w.gate_up, norm=w.post_norm, eps=self.eps, swiglu=True, squares=squares,
                               pdl=pdl)
            residual, squares = fused_linear(act, w.down, residual=residual, squares_out=True, pdl=pdl)
        if not final_norm:
            return residual, squares
        return add_rmsnorm(residual, None, self.final_norm, self.eps, self.final_norm.dtype)[0]

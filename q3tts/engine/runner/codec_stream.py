"""Incremental, exact decoding of the speech tokenizer: frames in, 1920 samples per frame out, with per-stream
state instead of re-decoded context.

Every stage of the decoder is causal, so it can run chunk by chunk if each stream keeps what the next chunk
needs from the past:
  * each causal convolution: its last `left_context` input samples (zeros at the start, which is exactly the
    whole-sequence decode's left padding);
  * each transposed convolution with overlap (kernel 2r, stride r): the last input step's second r output
    samples (without bias), still waiting to be added to the next step's first r;
  * each of the 8 attention layers: the keys and values of its last `window` frames (a ring);
  * the frame count (absolute RoPE position).
Concatenating the chunks gives the whole-sequence decode up to floating-point rounding (the products, overlap-adds
and softmax sums run in another order), for any chunk schedule, and is as close to the exact decode as it is: the
two differ by about the sum of their rounding errors, which the vocoder amplifies by a checkpoint-dependent gain
(docs/faithfulness.md, "Audio: how close two float32 decodes can be"). Nothing is decoded twice.

State size per stream (real config): 132 k numbers of convolution context, 9 k of transposed-convolution
overlap and 1.18 M of attention cache (8 layers x K and V x 16 heads x 72 frames x 64): 1.32 M numbers,
5.3 MB in fp32 (2.6 MB in bf16), whatever the stream's length; see `state_numel`.

Layout: the vocoder (the convolution stack after the upsampling, nearly all of the work) runs time-major through
the Triton kernels of `kernels/codec.py` (the PyTorch twins on the CPU); its kept contexts are
[rows, L, C] (each convolution's input is built with its context in front) and its transposed convolutions'
tails [rows, r, C]. The quantizer is one lookup in the stacked codebooks; the pre-transformer runs like the
engine's talker (fp32 residual stream, fused add + RMSNorm, fused projections; a one-frame step's attention is
one kernel); the upsampling runs channel-major in PyTorch.

Rows: the state is [max_rows, ...]; `decode(codes)` advances rows 0..B-1 in place (static addresses, so the
GPU path can capture it in a CUDA graph), `decode_rows(rows, codes)` any set of rows (gather/scatter; used to
prime a stream with a voice's reference codes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...kernels.activation import silu_mul
from ...kernels.codec import (
    attend,
    causal_conv,
    conv_transpose,
    residual_unit,
    ring_attention_step,
    snake_params,
    split_rotate,
)
from ...kernels.norm import add_rmsnorm
from ...layers.rotary import rope_cos_sin
from ...models.codec_decoder import (
    CausalConv1d,
    CausalConvTranspose1d,
    CodecAttention,
    CodecDecoder,
    ConvNeXtBlock,
    DecoderTransformer,
    SnakeBeta,
)
from ...transfer import to_device, zero_rows

SHORT_CONV = 32  # time steps per call up to which a dense convolution runs as one matrix product


class DecoderState:
    """All per-stream tensors, [rows, ...] each, in the order the decoder visits them."""

    def __init__(self, convs: list[torch.Tensor], tails: list[torch.Tensor], keys: list[torch.Tensor],
                 values: list[torch.Tensor], lengths: torch.Tensor):
        self.convs, self.tails, self.keys, self.values, self.lengths = convs, tails, keys, values, lengths

    def tensors(self) -> list[torch.Tensor]:
        return [*self.convs, *self.tails, *self.keys, *self.values, self.lengths]

    def view(self, n: int) -> DecoderState:
        """The first n rows, as views."""
        return DecoderState(*[[t[:n] for t in group] for group in (self.convs, self.tails, self.keys, self.values)],
                            self.lengths[:n])

    def gather(self, rows: torch.Tensor) -> DecoderState:
        return DecoderState(*[[t[rows] for t in group] for group in (self.convs, self.tails, self.keys, self.values)],
                            self.lengths[rows])

    def scatter(self, rows: torch.Tensor, part: DecoderState) -> None:
        for dst, src in zip(self.tensors(), part.tensors()):
            dst[rows] = src


class StreamingDecoder:
    """Per-row incremental decoding with a `CodecDecoder`'s modules and weights."""

    def __init__(self, decoder: CodecDecoder, max_rows: int):
        self.decoder = decoder
        weight = decoder.pre_conv.conv.weight
        self.device, self.dtype = weight.device, weight.dtype
        # The vocoder (the convolution stack after the upsampling) runs time-major: its kept contexts are
        # [rows, L, C]; the other stages' are [rows, C, L].
        vocoder = {id(m) for m in decoder.decoder.modules()}
        convs = [m for m in decoder.modules() if isinstance(m, CausalConv1d) and m.left_context > 0]
        tails = [m for m in decoder.modules() if isinstance(m, CausalConvTranspose1d) and m.trim > 0]
        attn = [m for m in decoder.modules() if isinstance(m, CodecAttention)]
        z = lambda *shape: torch.zeros(max_rows, *shape, dtype=self.dtype, device=self.device)
        # Codebook vectors are fixed: stacked once, [num_quantizers * codebook_size, dim] (the whole-sequence
        # decoder recomputes them per call), so one lookup serves all 16 codebooks.
        split = decoder.quantizer
        books = [layer.vectors() for rvq in (split.rvq_first, split.rvq_rest) for layer in rvq.vq.layers]
        self.codebook = torch.cat(books)
        self.codebook_offsets = torch.arange(len(books), device=self.device)[:, None] * books[0].shape[0]
        self.state = DecoderState(
            convs=[z(m.left_context, m.conv.in_channels) if id(m) in vocoder else z(m.conv.in_channels, m.left_context)
                   for m in convs],
            tails=[z(m.trim, m.conv.out_channels) for m in tails],
            keys=[z(m.num_kv_heads, m.window, m.head_dim) for m in attn],  # a ring: see _Transformer
            values=[z(m.num_kv_heads, m.window, m.head_dim) for m in attn],
            lengths=torch.zeros(max_rows, dtype=torch.long, device=self.device))
        self.transformer = _Transformer(decoder.pre_transformer)
        self.vocoder = _Vocoder(decoder.decoder)

    @property
    def state_numel(self) -> int:
        """Numbers of state per stream."""
        return sum(t[0].numel() for t in self.state.tensors())

    def reset(self, rows: list[int]) -> None:
        """Starts fresh streams in `rows` (zeros are exactly the whole-sequence decode's left padding)."""
        zero_rows(self.state.tensors(), rows)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """codes: [B, 16, T] for rows 0..B-1 -> their next T * 1920 samples [B, T * 1920]; state updated in place.
        Codes on the GPU are not range-checked (that would sync every step): the engine's are valid by
        construction."""
        if codes.device.type == "cpu":
            self._check_range(codes)
        return self._run(codes, self.state.view(codes.shape[0]), clamp)

    @torch.no_grad()
    def decode_rows(self, rows: list[int] | torch.Tensor, codes: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """Advances `rows` by codes [len(rows), 16, T] (e.g. a voice's reference codes). Pass them on the CPU to
        have them range-checked without a device sync (they are then copied in stream order)."""
        if codes.device.type == "cpu":
            self._check_range(codes)
            codes = to_device(codes, self.device)
        rows = to_device(rows, self.device)
        part = self.state.gather(rows)
        wav = self._run(codes, part, clamp)
        self.state.scatter(rows, part)
        return wav

    def _check_range(self, codes: torch.Tensor) -> None:
        """One lookup serves all codebooks, so a code beyond its codebook would silently read the next one."""
        size = self.decoder.config.codebook_size
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"codes must lie in [0, {size}), got values in [{int(codes.min())}, {int(codes.max())}]")

    def _run(self, codes: torch.Tensor, state: DecoderState, clamp: bool) -> torch.Tensor:
        d = self.decoder
        if codes.ndim != 3 or codes.shape[1] != d.config.num_quantizers:
            raise ValueError(f"expected codes [B, {d.config.num_quantizers}, T], got {list(codes.shape)}")
        wav = self.run_stages(codes, state)
        state.lengths += codes.shape[-1]
        return wav.clamp(min=-1, max=1) if clamp else wav

    def run_stages(self, codes: torch.Tensor, state: DecoderState, num_stages: int = 3) -> torch.Tensor:
        """The step's first `num_stages` stages on codes [B, 16, T], `state`'s lengths left as they are: 1, the
        quantizer, pre-conv and transformer ([B, latent, T]); 2, then the upsampling; 3, then the vocoder (the
        waveform, unclamped). Public for bench/profilers/profile_codec.py, which times each stage."""
        d = self.decoder
        cursor = _Cursor(state)
        hidden = self._conv(d.pre_conv, self._quantized(codes), cursor).transpose(1, 2)  # [B, T, latent]
        positions = state.lengths[:, None] + torch.arange(codes.shape[-1], device=codes.device)  # [B, T]
        hidden = self.transformer(hidden, positions, cursor).transpose(1, 2)
        if num_stages > 1:
            for blocks in d.upsample:
                for block in blocks:
                    hidden = self._upsample(block, hidden, cursor)
        if num_stages > 2:
            hidden = self.vocoder(hidden.transpose(1, 2), cursor)
        return hidden

    def _quantized(self, codes: torch.Tensor) -> torch.Tensor:
        """SplitResidualVectorQuantizer.decode with the stacked codebooks: [B, 16, T] -> [B, codebook_dim, T]."""
        split = self.decoder.quantizer
        n = split.num_semantic_quantizers
        vectors = F.embedding(codes + self.codebook_offsets, self.codebook)  # [B, 16, T, dim]
        first, rest = vectors[:, :n].sum(1).transpose(1, 2), vectors[:, n:].sum(1).transpose(1, 2)
        return split.rvq_first.output_proj(first) + split.rvq_rest.output_proj(rest)

    def _upsample(self, m, x: torch.Tensor, cursor: _Cursor) -> torch.Tensor:
        if isinstance(m, CausalConvTranspose1d):
            return self._conv_transpose(m, x)
        if isinstance(m, ConvNeXtBlock):
            h = self._conv(m.dwconv, x, cursor).permute(0, 2, 1)
            h = m.pwconv2(F.gelu(m.pwconv1(m.norm(h))))
            return x + (m.gamma * h).permute(0, 2, 1)
        raise TypeError(f"no streaming rule for {type(m).__name__}")

    @staticmethod
    def _conv(m: CausalConv1d, x: torch.Tensor, cursor: _Cursor) -> torch.Tensor:
        """x: [B, C, T] -> [B, C', T]: the kept left context replaces the zero padding."""
        if m.left_context == 0:
            return m.conv(x)
        state = cursor.next_conv()
        full = torch.cat([state, x], dim=-1)
        state.copy_(full[..., full.shape[-1] - m.left_context:])
        c = m.conv
        T, k, d = x.shape[-1], c.kernel_size[0], c.dilation[0]
        if c.groups == c.in_channels == c.out_channels:  # depthwise: k shifted multiply-adds
            taps = full.unfold(-1, (k - 1) * d + 1, 1)[..., ::d]  # [B, C, T, k] (a view)
            return (taps * c.weight[:, 0][None, :, None]).sum(-1) + c.bias[None, :, None]
        if c.groups == 1 and T <= SHORT_CONV:
            # Few steps, many channels: one matrix product over the gathered taps (cuDNN falls back to a slow
            # implicit-GEMM kernel on these shapes).
            taps = torch.stack([full[..., j * d: j * d + T] for j in range(k)], dim=2)  # [B, C, k, T]
            out = c.weight.view(c.out_channels, -1) @ taps.view(full.shape[0], -1, T)
            return out + c.bias[None, :, None] if c.bias is not None else out
        return F.conv1d(full, c.weight, c.bias, c.stride, 0, c.dilation, c.groups)

    @staticmethod
    def _conv_transpose(m: CausalConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C, T] -> [B, C', T * stride] with kernel = stride (no overlap, no state): one matrix product."""
        c = m.conv
        B, _, T = x.shape
        s = c.stride[0]
        if c.kernel_size[0] != s:
            raise NotImplementedError(f"streaming transposed conv with kernel {c.kernel_size[0]} and stride {s}")
        steps = (x.transpose(1, 2).reshape(B * T, -1) @ c.weight.view(c.in_channels, -1)).view(B, T, -1, s)
        out = steps.permute(0, 2, 1, 3).reshape(B, -1, T * s)
        return out + c.bias[None, :, None] if c.bias is not None else out

class _Transformer:
    """The pre-transformer for incremental steps, as the engine's talker runs: an fp32 residual stream with fused
    add + RMSNorm, q/k/v and gate/up as single matrices, the layer scales folded into o_proj and down_proj, and
    the window mask built once per call. Each new frame attends to the kept window of past frames and to the new
    frames up to itself."""

    def __init__(self, t: DecoderTransformer):
        self.t = t
        self.layers = []
        for layer in t.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                a, layer.input_layernorm, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                (layer.self_attn_layer_scale.scale[:, None] * a.o_proj.weight).detach(),
                layer.post_attention_layernorm, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                (layer.mlp_layer_scale.scale[:, None] * mlp.down_proj.weight).detach()))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cursor: _Cursor) -> torch.Tensor:
        """x: [B, T, latent]; positions: [B, T] -> [B, T, latent]."""
        t = self.t
        B, T, _ = x.shape
        h = t.input_proj(x).view(B * T, -1)
        dtype = h.dtype
        residual = None
        attend = self._one_frame if T == 1 else self._frames(positions, dtype)
        for layer in self.layers:
            y, residual = add_rmsnorm(h, residual, layer.norm1.weight, layer.norm1.eps, dtype)
            out = attend(F.linear(y, layer.qkv), positions, layer.attn, *cursor.next_kv())
            h = F.linear(out, layer.o)
            y, residual = add_rmsnorm(h, residual, layer.norm2.weight, layer.norm2.eps, dtype)
            h = F.linear(silu_mul(F.linear(y, layer.gate_up)), layer.down)
        y, _ = add_rmsnorm(h, residual, t.norm.weight, t.norm.eps, dtype)
        return t.output_proj(y).view(B, T, -1)

    # The kept keys and values are a ring of `window` slots, position p in slot p % window. One new frame (the
    # engine's step) writes its slot and attends to the whole ring (`ring_attention_step`); longer calls put the
    # past in order before the new frames and write the last `window` positions back.
    def _one_frame(self, qkv: torch.Tensor, positions: torch.Tensor, a: CodecAttention, k_ring: torch.Tensor,
                   v_ring: torch.Tensor) -> torch.Tensor:
        return ring_attention_step(qkv, positions[:, 0], k_ring, v_ring, self.t.inv_freq, a.num_heads, a.scale)

    def _frames(self, positions: torch.Tensor, dtype: torch.dtype):
        """The attention of a call of T > 1 frames per row (masks and ring indices built once for all layers)."""
        B, T = positions.shape
        a = self.layers[0].attn
        W, shape = a.window, (B, a.num_kv_heads, -1, a.head_dim)
        cos, sin = (c.to(dtype)[:, :, None] for c in rope_cos_sin(positions, self.t.inv_freq))  # [B, T, 1, D]
        past = positions[:, :1] - (W - 1) + torch.arange(W - 1, device=positions.device)  # [B, W - 1]
        key_pos = torch.cat([past, positions], dim=1)
        q_pos = positions[:, :, None]
        visible = ((key_pos[:, None, :] <= q_pos) & (key_pos[:, None, :] > q_pos - W)
                   & (key_pos[:, None] >= 0))[:, None]  # [B, 1, T, W - 1 + T]
        take, put = (p[:, None, :, None].expand(shape) for p in (past % W, key_pos[:, -W:] % W))

        def frames(qkv, positions, a, k_ring, v_ring):
            q, k, v = split_rotate(qkv.view(B, T, -1, a.head_dim), cos, sin, a.num_heads)
            keys = torch.cat([k_ring.gather(2, take), k], dim=2)
            values = torch.cat([v_ring.gather(2, take), v], dim=2)
            k_ring.scatter_(2, put, keys[:, :, -W:])
            v_ring.scatter_(2, put, values[:, :, -W:])
            return attend(q, keys, values, visible, a.scale).transpose(1, 2).reshape(B * T, -1)

        return frames


class _Layer(NamedTuple):
    attn: CodecAttention
    norm1: torch.nn.Module
    qkv: torch.Tensor  # [q; k; v] rows
    o: torch.Tensor  # o_proj with the attention layer scale folded in
    norm2: torch.nn.Module
    gate_up: torch.Tensor  # [gate; up] rows
    down: torch.Tensor  # down_proj with the MLP layer scale folded in


class _Vocoder:
    """The convolution stack after the upsampling (causal conv, blocks of SnakeBeta + transposed conv + residual
    units, SnakeBeta, causal conv) with its weights packed for the time-major kernels (a second copy of ~52 M
    numbers: the whole-sequence decoder keeps the originals). Every SnakeBeta runs in the epilogue of the
    operation before it."""

    def __init__(self, stack: torch.nn.ModuleList):
        conv_in, *blocks, last_snake, conv_out = stack
        self.conv_in, self.conv_out = _PackedConv(conv_in), _PackedConv(conv_out)
        self.blocks = []
        for block in blocks:
            first, up, *units = block.block
            w = up.conv.weight.detach()  # [C_in, C_out, 2s] -> [C_in, 2s * C_out]
            self.blocks.append(_Block(_snake(first), w.permute(0, 2, 1).reshape(w.shape[0], -1).contiguous(),
                                      up.conv.bias.detach(), up.conv.stride[0],
                                      [(_snake(u.act1), _PackedConv(u.conv1), _snake(u.act2), _PackedConv(u.conv2))
                                       for u in units]))
        self.last_snake = _snake(last_snake)

    def __call__(self, x: torch.Tensor, cursor: _Cursor) -> torch.Tensor:
        """x: [B, T, C] -> [B, T * samples per step]. Each convolution's input is produced with the convolution's
        kept context in front (`act_context`), so the states are taken from the cursor one producer ahead."""
        following = [block.snake for block in self.blocks] + [self.last_snake]
        state = cursor.next_conv()
        _, act = self.conv_in(torch.cat([state, x], dim=1), state, snake=following[0], keep_out=False)
        for b, (block, after) in enumerate(zip(self.blocks, following[1:])):
            units = block.units
            state = cursor.next_conv()  # the first residual unit's
            y, act = conv_transpose(act, cursor.next_tail(), block.weight, block.bias, block.stride, units[0][0],
                                    act_context=state)
            for i, (_, conv1, snake2, conv2) in enumerate(units):
                last = i + 1 == len(units)
                # The next block's transposed convolution keeps no context; the last block's last unit feeds
                # conv_out, which does.
                next_state = cursor.next_conv() if not last or b + 1 == len(self.blocks) else None
                y, act = residual_unit(act, state, conv1.weight, conv1.bias, snake2, conv2.weight, conv2.bias, y,
                                       after if last else units[i + 1][0], conv1.dilation, keep_out=not last,
                                       act_context=next_state)
                state = next_state
        wav, _ = self.conv_out(act, state)
        return wav[..., 0]


def _snake(m: SnakeBeta) -> tuple[torch.Tensor, torch.Tensor]:
    return snake_params(m.alpha.detach(), m.beta.detach())


class _Block(NamedTuple):
    snake: tuple[torch.Tensor, torch.Tensor]  # the SnakeBeta before the transposed convolution
    weight: torch.Tensor  # the transposed convolution's, [C_in, 2s * C_out]
    bias: torch.Tensor
    stride: int
    units: list  # (snake1, conv1, snake2, conv2) per residual unit


class _PackedConv:
    """A `CausalConv1d`'s weight as [k, C_in, C_out] for `causal_conv`."""

    def __init__(self, m: CausalConv1d):
        self.weight = m.conv.weight.detach().permute(2, 1, 0).contiguous()
        self.bias, self.dilation = m.conv.bias.detach(), m.conv.dilation[0]

    def __call__(self, x: torch.Tensor, state: torch.Tensor | None, **kwargs):
        return causal_conv(x, state, self.weight, self.bias, self.dilation, **kwargs)


class _Cursor:
    """Hands out a state's tensors in the order the decoder visits the stateful modules."""

    def __init__(self, state: DecoderState):
        self.convs, self.tails = iter(state.convs), iter(state.tails)
        self.kv = iter(zip(state.keys, state.values))

    def next_conv(self) -> torch.Tensor:
        return next(self.convs)

    def next_tail(self) -> torch.Tensor:
        return next(self.tails)

    def next_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return next(self.kv)

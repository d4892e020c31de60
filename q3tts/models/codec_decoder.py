"""The speech tokenizer's decoder: 16 codes per 12.5 Hz frame -> 24 kHz waveform (1920 samples per frame).

Pipeline (official `Qwen3TTSTokenizerV2Decoder`): split-RVQ lookup -> causal conv -> 8-layer transformer with
sliding-window causal attention -> 2 x (transposed conv x2 + ConvNeXt) -> causal conv -> 4 x (SnakeBeta +
transposed conv + 3 dilated residual units) -> SnakeBeta -> causal conv -> clamp to [-1, 1].

Every stage is causal, so the whole-sequence `forward` here is exact for any length (the official `decode`
re-decodes 300-frame chunks with 25 frames of context, which is exact only up to 300 frames). The small conv
modules state their left context (`left_context`, `trim`) and the attention its `window`, which is what a
streaming decoder needs to keep per stream; they are written so one can reuse these modules and weights.

Parameter names are the checkpoint's names under `decoder.`; the quantizer `input_proj` weights (used only to
encode) are deliberately not part of this module (see `IGNORED_TENSORS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CodecDecoderConfig
from ..layers.attention import MLP
from ..layers.norm import RMSNorm
from ..layers.rotary import apply_rope, inv_frequencies, rope_cos_sin

# Checkpoint tensors under `decoder.` this module does not hold, as regular expressions (full match).
IGNORED_TENSORS = (r"quantizer\.rvq_(first|rest)\.input_proj\.weight",)

CODEBOOK_EPSILON = 1e-5  # clamp on EMA cluster usage, as in the official EuclideanCodebook


def ignored_shapes(config: CodecDecoderConfig) -> dict[str, tuple[int, ...]]:
    """Names (without `decoder.`) and shapes of the checkpoint tensors covered by `IGNORED_TENSORS`."""
    dim = config.codebook_dim // 2
    return {f"quantizer.{q}.input_proj.weight": (dim, config.codebook_dim, 1) for q in ("rvq_first", "rvq_rest")}


# ---------------------------------------------------------------------------------------------------------------
# Convolutions and activations (shared with the encoder)
# ---------------------------------------------------------------------------------------------------------------


class CausalConv1d(nn.Module):
    """Conv1d that sees only the past: `left_context` samples of left padding, and on the right only what
    completes the last stride (so the output has ceil(T / stride) steps).

    A streaming version keeps the last `left_context` input samples of each stream instead of padding.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, dilation: int = 1,
                 groups: int = 1, bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation,
                              groups=groups, bias=bias)
        self.stride = stride
        self.left_context = (kernel_size - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode  # "constant" (zeros) or "replicate" (Mimi's downsample conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C_in, T] -> [B, C_out, ceil(T / stride)]."""
        right = -x.shape[-1] % self.stride
        if self.pad_mode == "constant":
            x = F.pad(x, (self.left_context, right), mode="constant", value=0.0)
        else:
            x = F.pad(x, (self.left_context, right), mode=self.pad_mode)
        return self.conv(x)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d (weight [in, out, k]) with the last `trim = k - stride` output samples dropped.

    Those samples are the part of the overlap-add still waiting for the next input step; a streaming version
    holds them back and adds them to the next call's first `trim` samples.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C_in, T] -> [B, C_out, T * stride]."""
        x = self.conv(x)
        if self.trim > 0:
            x = x[..., : x.shape[-1] - self.trim]
        return x


class SnakeBeta(nn.Module):
    """`x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2` per channel; alpha and beta are stored in log scale."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C, T]."""
        alpha = torch.exp(self.alpha[None, :, None])
        beta = torch.exp(self.beta[None, :, None])
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k=7) -> LayerNorm -> Linear x4 -> GELU -> Linear -> gamma scale, plus residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, C, T]."""
        h = self.dwconv(x).permute(0, 2, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    """SnakeBeta -> causal conv k7 (dilated) -> SnakeBeta -> conv k1, plus residual."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act2(self.conv1(self.act1(x)))) + x


class DecoderBlock(nn.Module):
    """`block` = [SnakeBeta, transposed conv (x rate), residual units with dilation 1, 3, 9]."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------------------------
# Transformer (shared attention with the encoder)
# ---------------------------------------------------------------------------------------------------------------


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class CodecAttention(nn.Module):
    """Causal multi-head attention with RoPE, no biases and no qk-norm; `window` keys per query (itself
    included) when set, as transformers' sliding-window mask `k > q - window`.

    Runs through SDPA the way transformers' sdpa path calls it (plain `is_causal` when the window cannot
    matter, a boolean mask otherwise), so results match the official ones to rounding.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, window: int | None,
                 pass_scale: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.window = window
        # The decoder's sdpa path passes `scale=head_dim**-0.5`; Mimi's lets SDPA derive it.
        self.scale = head_dim**-0.5 if pass_scale else None
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; cos/sin: [1, T, head_dim] -> [B, T, hidden]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        mask = self.prepare_mask(t, x.device)
        kwargs = {} if self.scale is None else {"scale": self.scale}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1, **kwargs)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def prepare_mask(self, t: int, device: torch.device) -> torch.Tensor | None:
        """None when plain causal attention is exact (no window, or fewer steps than the window), else a
        boolean [T, T] mask (True = attend)."""
        if self.window is None or t < self.window:
            return None
        q = torch.arange(t, device=device)[:, None]
        k = torch.arange(t, device=device)[None, :]
        return (k <= q) & (k > q - self.window)


class DecoderTransformerLayer(nn.Module):
    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        c = config
        self.self_attn = CodecAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                        window=c.sliding_window)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class DecoderTransformer(nn.Module):
    """`pre_transformer`: Linear latent->hidden, N layers, RMSNorm, Linear hidden->latent; 12.5 Hz in and out."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.layers = nn.ModuleList([DecoderTransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", inv_frequencies(config.head_dim, config.rope_theta), persistent=False)

    def init_buffers(self) -> None:
        """Recomputes the non-persistent RoPE frequencies (after building on the meta device)."""
        self.inv_freq = inv_frequencies(self.head_dim, self.rope_theta, device=self.output_proj.weight.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, T, latent]; positions: [T] absolute frame indices -> [B, T, latent]."""
        cos, sin = rope_cos_sin(positions[None], self.inv_freq)
        x = self.input_proj(x)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output_proj(self.norm(x))


# ---------------------------------------------------------------------------------------------------------------
# Split residual vector quantizer (decode side)
# ---------------------------------------------------------------------------------------------------------------


class EuclideanCodebook(nn.Module):
    """One codebook stored as EMA accumulators; vector i = embedding_sum[i] / max(cluster_usage[i], 1e-5)."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embedding_sum = nn.Parameter(torch.zeros(codebook_size, dim))

    def vectors(self) -> torch.Tensor:
        """[codebook_size, dim]; recomputed per call as the official code does (cheap next to the decoder)."""
        return self.embedding_sum / self.cluster_usage.clamp(min=CODEBOOK_EPSILON)[:, None]


class VectorQuantization(nn.Module):
    """Holds `_codebook`, keeping the official `layers.{k}._codebook` names (its projection is the identity)."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self._codebook = EuclideanCodebook(codebook_size, dim)

    def vectors(self) -> torch.Tensor:
        """[codebook_size, dim]: the codebook's vectors."""
        return self._codebook.vectors()


class ResidualCodebooks(nn.Module):
    """`vq`: the codebooks of one residual quantizer."""

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([VectorQuantization(codebook_size, dim) for _ in range(num_quantizers)])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, K, T] -> sum of the K looked-up vectors, [B, dim, T] (summed in codebook order)."""
        out = None
        for k, layer in enumerate(self.layers):
            vec = F.embedding(codes[:, k], layer.vectors()).transpose(1, 2)
            out = vec if out is None else out + vec
        return out


class ResidualVectorQuantizer(nn.Module):
    """`rvq_first` / `rvq_rest`: codebooks plus a 1x1 conv back to the codec width."""

    def __init__(self, num_quantizers: int, codebook_size: int, dim: int, output_dim: int):
        super().__init__()
        self.vq = ResidualCodebooks(num_quantizers, codebook_size, dim)
        self.output_proj = nn.Conv1d(dim, output_dim, 1, bias=False)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, K, T] -> [B, output_dim, T]."""
        return self.output_proj(self.vq.decode(codes))


class SplitResidualVectorQuantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate output projections; their sum is the
    quantized latent."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        dim = config.codebook_dim // 2
        n_first = config.num_semantic_quantizers
        self.num_semantic_quantizers = n_first
        self.rvq_first = ResidualVectorQuantizer(n_first, config.codebook_size, dim, config.codebook_dim)
        self.rvq_rest = ResidualVectorQuantizer(config.num_quantizers - n_first, config.codebook_size, dim,
                                                config.codebook_dim)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, num_quantizers, T] -> [B, codebook_dim, T]."""
        n = self.num_semantic_quantizers
        return self.rvq_first.decode(codes[:, :n]) + self.rvq_rest.decode(codes[:, n:])


# ---------------------------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------------------------


class CodecDecoder(nn.Module):
    """Codes [B, 16, T] -> waveform [B, 1, T * 1920] in [-1, 1], decoded exactly over the whole sequence."""

    def __init__(self, config: CodecDecoderConfig):
        super().__init__()
        if config.num_semantic_quantizers >= config.num_quantizers:
            raise ValueError("the decoder needs at least one acoustic codebook")
        self.config = config
        self.quantizer = SplitResidualVectorQuantizer(config)
        self.pre_conv = CausalConv1d(config.codebook_dim, config.latent_dim, kernel_size=3)
        self.pre_transformer = DecoderTransformer(config)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(config.latent_dim, config.latent_dim, r, r),
                           ConvNeXtBlock(config.latent_dim)])
            for r in config.upsampling_ratios)
        dims = [config.decoder_dim // 2**i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.latent_dim, dims[0], kernel_size=7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, kernel_size=7)])

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def forward(self, codes: torch.Tensor, clamp: bool = True) -> torch.Tensor:
        """codes: [B, num_quantizers, T] int64 in [0, codebook_size) -> [B, 1, T * samples_per_frame].

        `clamp=False` returns the waveform before the final clamp to [-1, 1] (for checking levels).
        """
        hidden = self.features(codes)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1) if clamp else hidden

    def features(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, num_quantizers, T] -> the vocoder's input, [B, latent_dim, T * prod(upsampling_ratios)]."""
        if codes.ndim != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"expected codes [B, {self.config.num_quantizers}, T], got {list(codes.shape)}")
        latent = self.quantizer.decode(codes)  # [B, codebook_dim, T]
        hidden = self.pre_conv(latent).transpose(1, 2)  # [B, T, latent]
        positions = torch.arange(codes.shape[-1], device=codes.device)
        hidden = self.pre_transformer(hidden, positions).transpose(1, 2)  # [B, latent, T]
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden)
        return hidden

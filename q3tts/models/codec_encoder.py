"""The speech tokenizer's encoder: 24 kHz mono waveform -> 16 codes per 12.5 Hz frame.

It is transformers' `MimiModel.encode` path (transformers 4.57.3, as the official package uses it): SEANet
causal conv encoder (hop 960) -> causal transformer -> strided conv with replicate padding (hop 1920) -> split
RVQ, where the semantic and the acoustic quantizer both quantize the same latent, by nearest neighbour in fp32.

Attention is causal over the WHOLE sequence, not windowed: transformers' Mimi builds its mask with
`create_causal_mask`, so `sliding_window` only bounds a streaming KV cache and never masks a one-call encode.
The official codes therefore come from full causal attention, and so do these (for inputs under
`sliding_window` encoder steps, 10 s at the real 250, the two are the same thing anyway).

Parameter names are the checkpoint's names under `encoder.`. Tensors that encoding never reads are
deliberately not part of this module (`ignored_patterns` / `ignored_shapes`): the RVQ output projections, the
`initialized` flags and the acoustic codebooks beyond the `num_valid_quantizers - 1` that are kept.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CodecEncoderConfig
from ..layers.rotary import inv_frequencies, rope_cos_sin
from .codec_decoder import CODEBOOK_EPSILON, CausalConv1d, CodecAttention, LayerScale

# MimiConfig.sampling_rate; the speech tokenizer's encoder_config never sets it.
MIMI_SAMPLING_RATE = 24000
SEMANTIC = "quantizer.semantic_residual_vector_quantizer"
ACOUSTIC = "quantizer.acoustic_residual_vector_quantizer"


def ignored_patterns(config: CodecEncoderConfig, num_valid_quantizers: int) -> list[str]:
    """Regular expressions (full match, names without `encoder.`) for checkpoint tensors encoding never reads."""
    first_unused = num_valid_quantizers - config.num_semantic_quantizers
    num_acoustic = config.num_quantizers - config.num_semantic_quantizers
    patterns = [r"quantizer\.(semantic|acoustic)_residual_vector_quantizer\.output_proj\.weight",
                r"quantizer\.(semantic|acoustic)_residual_vector_quantizer\.layers\.\d+\.codebook\.initialized"]
    if first_unused < num_acoustic:
        unused = "|".join(str(i) for i in range(first_unused, num_acoustic))
        patterns.append(rf"quantizer\.acoustic_residual_vector_quantizer\.layers\.({unused})\.codebook\."
                        r"(cluster_usage|embed_sum)")
    return patterns


def ignored_shapes(config: CodecEncoderConfig, num_valid_quantizers: int) -> dict[str, tuple[int, ...]]:
    """Names (without `encoder.`) and shapes of the checkpoint tensors covered by `ignored_patterns`."""
    c = config
    num_acoustic = c.num_quantizers - c.num_semantic_quantizers
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, num in ((SEMANTIC, c.num_semantic_quantizers), (ACOUSTIC, num_acoustic)):
        if c.codebook_dim != c.hidden_size:
            shapes[f"{prefix}.output_proj.weight"] = (c.hidden_size, c.codebook_dim, 1)
        for i in range(num):
            shapes[f"{prefix}.layers.{i}.codebook.initialized"] = (1,)
    for i in range(num_valid_quantizers - c.num_semantic_quantizers, num_acoustic):
        shapes[f"{ACOUSTIC}.layers.{i}.codebook.cluster_usage"] = (c.codebook_size,)
        shapes[f"{ACOUSTIC}.layers.{i}.codebook.embed_sum"] = (c.codebook_size, c.codebook_dim)
    return shapes


# ---------------------------------------------------------------------------------------------------------------
# SEANet encoder
# ---------------------------------------------------------------------------------------------------------------


class ResnetBlock(nn.Module):
    """`block` = [ELU, conv k3 (dim -> dim/compress), ELU, conv k1 (-> dim)], identity shortcut."""

    def __init__(self, config: CodecEncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([nn.ELU(), CausalConv1d(dim, hidden, config.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), CausalConv1d(hidden, dim, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SeanetEncoder(nn.Module):
    """`layers`: conv; per ratio (smallest first): residual blocks, ELU, strided conv doubling the width; ELU;
    conv to hidden_size. [B, 1, L] -> [B, hidden, ceil(L / prod(ratios))]."""

    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        c = config
        layers: list[nn.Module] = [CausalConv1d(c.audio_channels, c.num_filters, c.kernel_size)]
        width = c.num_filters
        for ratio in reversed(c.upsampling_ratios):
            layers += [ResnetBlock(c, width, c.dilation_growth_rate**j) for j in range(c.num_residual_layers)]
            layers += [nn.ELU(), CausalConv1d(width, 2 * width, kernel_size=2 * ratio, stride=ratio)]
            width *= 2
        layers += [nn.ELU(), CausalConv1d(width, c.hidden_size, c.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------------------


class MimiMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.fc2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderTransformerLayer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        c = config
        # window=None: see the module docstring (the official encode never applies sliding_window).
        self.self_attn = CodecAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                        window=None, pass_scale=False)
        self.mlp = MimiMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.self_attn_layer_scale = LayerScale(c.hidden_size)
        self.mlp_layer_scale = LayerScale(c.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    def __init__(self, config: CodecEncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList([EncoderTransformerLayer(config) for _ in range(config.num_hidden_layers)])
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", inv_frequencies(config.head_dim, config.rope_theta), persistent=False)

    def init_buffers(self) -> None:
        """Recomputes the non-persistent RoPE frequencies (after building on the meta device)."""
        device = self.layers[0].input_layernorm.weight.device if len(self.layers) else None
        self.inv_freq = inv_frequencies(self.head_dim, self.rope_theta, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]."""
        positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_cos_sin(positions[None], self.inv_freq)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


# ---------------------------------------------------------------------------------------------------------------
# Split residual vector quantizer (encode side)
# ---------------------------------------------------------------------------------------------------------------


class MimiCodebook(nn.Module):
    """EMA accumulators; vector i = embed_sum[i] / max(cluster_usage[i], 1e-5)."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(codebook_size))
        self.embed_sum = nn.Parameter(torch.zeros(codebook_size, dim))

    def vectors(self) -> torch.Tensor:
        return self.embed_sum / self.cluster_usage.clamp(min=CODEBOOK_EPSILON)[:, None]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, D, T] -> (codes [B, T], their vectors [B, D, T]).

        Nearest neighbour by `torch.cdist` in fp32 over the flattened [B*T, D] rows, exactly as Mimi calls it
        (cdist's matmul path rounds; the same call keeps near-ties resolving the same way).
        """
        b, d, t = x.shape
        vectors = self.vectors()
        rows = x.permute(0, 2, 1).reshape(-1, d)
        codes = torch.cdist(rows[None].float(), vectors[None].float(), p=2)[0].argmin(dim=-1).view(b, t)
        return codes, F.embedding(codes, vectors).permute(0, 2, 1)


class MimiVectorQuantization(nn.Module):
    """Holds `codebook`, keeping Mimi's `layers.{k}.codebook` names."""

    def __init__(self, codebook_size: int, dim: int):
        super().__init__()
        self.codebook = MimiCodebook(codebook_size, dim)


class MimiResidualQuantizer(nn.Module):
    """1x1 input projection (when the codebook width differs from the latent), then residual quantization."""

    def __init__(self, config: CodecEncoderConfig, num_quantizers: int):
        super().__init__()
        c = config
        self.input_proj = nn.Conv1d(c.hidden_size, c.codebook_dim, 1, bias=False) if c.codebook_dim != c.hidden_size \
            else None
        self.layers = nn.ModuleList([MimiVectorQuantization(c.codebook_size, c.codebook_dim)
                                     for _ in range(num_quantizers)])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, hidden, T] -> codes [B, K, T]."""
        residual = self.input_proj(x) if self.input_proj is not None else x
        codes = []
        for layer in self.layers:
            indices, quantized = layer.codebook.quantize(residual)
            residual = residual - quantized
            codes.append(indices)
        return torch.stack(codes, dim=1)


class MimiSplitQuantizer(nn.Module):
    """Semantic and acoustic quantizers both quantize the same latent; codes = [semantic, acoustic...]."""

    def __init__(self, config: CodecEncoderConfig, num_valid_quantizers: int):
        super().__init__()
        self.semantic_residual_vector_quantizer = MimiResidualQuantizer(config, config.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = MimiResidualQuantizer(
            config, num_valid_quantizers - config.num_semantic_quantizers)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, hidden, T] -> codes [B, num_valid_quantizers, T]."""
        return torch.cat([self.semantic_residual_vector_quantizer.encode(x),
                          self.acoustic_residual_vector_quantizer.encode(x)], dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The encoder
# ---------------------------------------------------------------------------------------------------------------


class CodecEncoder(nn.Module):
    """Waveform [B, 1, L] (24 kHz) -> codes [B, num_valid_quantizers, ceil(L / 1920)]."""

    def __init__(self, config: CodecEncoderConfig, num_valid_quantizers: int):
        super().__init__()
        c = config
        if not c.num_semantic_quantizers < num_valid_quantizers <= c.num_quantizers:
            raise ValueError(f"num_valid_quantizers {num_valid_quantizers} must be in "
                             f"({c.num_semantic_quantizers}, {c.num_quantizers}]")
        if c.pad_mode != "constant":
            raise ValueError(f"encoder pad_mode {c.pad_mode!r} is not supported (only 'constant')")
        if c.hidden_act != "gelu":
            raise ValueError(f"encoder hidden_act {c.hidden_act!r} is not supported (only 'gelu')")
        hop = math.prod(c.upsampling_ratios)
        seanet_rate = math.ceil(MIMI_SAMPLING_RATE / hop)  # Mimi's `encodec_frame_rate`
        if seanet_rate == c.frame_rate:
            raise ValueError("encoders without a downsampling conv (frame_rate == SEANet rate) are not supported")
        self.config = config
        self.num_valid_quantizers = num_valid_quantizers
        self.samples_per_frame = 2 * hop  # Mimi's downsample conv always has stride 2
        self.encoder = SeanetEncoder(c)
        self.encoder_transformer = EncoderTransformer(c)
        self.downsample = CausalConv1d(c.hidden_size, c.hidden_size, kernel_size=2 * int(seanet_rate / c.frame_rate),
                                       stride=2, bias=False, pad_mode="replicate")
        self.quantizer = MimiSplitQuantizer(c, num_valid_quantizers)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav: [B, 1, L] -> codes [B, num_valid_quantizers, ceil(L / samples_per_frame)] (int64).

        Items of a right-padded batch are encoded over their padding too (the official behaviour: only
        the trailing frame can differ from encoding the item alone)."""
        hidden = self.encoder(wav)  # [B, hidden, ceil(L / hop)]
        hidden = self.encoder_transformer(hidden.transpose(1, 2)).transpose(1, 2)
        hidden = self.downsample(hidden)  # [B, hidden, T]
        return self.quantizer.encode(hidden)

"""Qwen3 decoder layer (q/k RMSNorm, GQA, RoPE, SwiGLU) over a preallocated slot-based KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm
from .rotary import apply_rope, inv_frequencies, rope_cos_sin


class KVCache:
    """Keys and values of every layer for `num_slots` independent sequences.

    k, v: [num_layers, num_slots, max_len, num_kv_heads, head_dim]. A sequence owns one slot and writes the
    token at position p to index p, so a row's valid keys are exactly indices 0..p and rows of a batch can
    start, advance and finish independently.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, bias: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps)  # per head, before RoPE
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; positions: [B, T]; slots: [B]. Writes this step's k/v, attends causally."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.k[layer][slots[:, None], positions] = k.transpose(1, 2).to(cache.k.dtype)
        cache.v[layer][slots[:, None], positions] = v.to(cache.v.dtype)
        span = int(positions.max()) + 1
        keys = cache.k[layer][slots, :span].transpose(1, 2).to(q.dtype)  # [B, kv_heads, span, D]
        values = cache.v[layer][slots, :span].transpose(1, 2).to(q.dtype)
        visible = torch.arange(span, device=x.device)[None, None, :] <= positions[:, :, None]  # [B, T, span]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None],
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, bias: bool):
        super().__init__()
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, eps, bias)
        self.mlp = MLP(hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """`layers` + final `norm` + RoPE frequencies: the part the talker and the code predictor share (their
    checkpoint names are `<model>.layers.*` and `<model>.norm`)."""

    def __init__(self, num_layers: int, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, bias: bool, rope_theta: float):
        super().__init__()
        self.layers = nn.ModuleList(
            DecoderLayer(hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, eps, bias)
            for _ in range(num_layers))
        self.norm = RMSNorm(hidden_size, eps)
        # Not in the checkpoint: always computed (a zero inv_freq silently removes all position information).
        self.rope_dim, self.rope_theta = head_dim, rope_theta
        self.register_buffer("inv_freq", inv_frequencies(head_dim, rope_theta), persistent=False)

    def init_buffers(self) -> None:
        self.inv_freq = inv_frequencies(self.rope_dim, self.rope_theta, self.norm.weight.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; positions: [B, T]; slots: [B] -> the normed hidden states [B, T, hidden]."""
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, cache, i, slots)
        return self.norm(x)


@dataclass
class FusedLayerWeights:
    """One decoder layer's weights as the fused GPU path uses them: q/k/v and gate/up concatenated."""

    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden]
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


def fuse_layer(layer: DecoderLayer) -> FusedLayerWeights:
    """Concatenates q/k/v and gate/up into single matrices and re-points the original parameters at views of
    them, so the unfused modules keep working on the same memory (no copy is kept)."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_proj.bias is not None:
        raise NotImplementedError("the fused path does not support attention biases")
    qkv = _concat_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = _concat_into_views([mlp.gate_proj, mlp.up_proj])
    return FusedLayerWeights(qkv=qkv, o=attn.o_proj.weight, gate_up=gate_up, down=mlp.down_proj.weight,
                             input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                             q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight)


def _concat_into_views(linears: list[nn.Linear]) -> torch.Tensor:
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused

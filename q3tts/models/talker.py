"""The talker: a Qwen3 decoder over summed text + codec embeddings that predicts codebook 0 of each frame."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TalkerConfig
from ..layers.attention import DecoderStack, KVCache
from .code_predictor import CodePredictor


class TalkerModel(DecoderStack):
    """`talker.model`: 28 decoder layers, the final norm, and the codec and text embeddings."""

    def __init__(self, config: TalkerConfig):
        c = config
        super().__init__(c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                         c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.attention_bias, c.rope_theta)
        self.codec_embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.text_embedding = nn.Embedding(c.text_vocab_size, c.text_hidden_size)


class TextProjection(nn.Module):
    """`talker.text_projection`: text hidden (2048) -> talker hidden, a SiLU MLP with biases."""

    def __init__(self, text_hidden_size: int, hidden_size: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden_size, text_hidden_size, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """`talker`: the decoder, the text projection, the codebook-0 head and the code predictor."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.model = TalkerModel(config)
        self.text_projection = TextProjection(config.text_hidden_size, config.hidden_size)
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor_config, config.hidden_size)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """tp(ids) = text_projection(text_embedding(ids)): [...] -> [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """F(c) = Ec(c0) + sum_j Ecp[j-1](c_j): codes [..., 16] -> [..., H], summed in the official order."""
        parts = [self.model.codec_embedding(codes[..., 0])]
        parts += [emb(codes[..., j + 1]) for j, emb in enumerate(self.code_predictor.model.codec_embedding)]
        return torch.stack(parts, dim=-2).sum(-2)

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        c, w = self.config, self.codec_head.weight
        return KVCache(c.num_hidden_layers, num_slots, max_len, c.num_key_value_heads, c.head_dim,
                       dtype or w.dtype, w.device)

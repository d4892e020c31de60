"""The code predictor: a 5-layer decoder that predicts codebooks 1..15 of a frame, one per step."""

from __future__ import annotations

import torch
from torch import nn

from ..config import CodePredictorConfig
from ..layers.attention import DecoderStack, KVCache


class CodePredictorModel(DecoderStack):
    """`talker.code_predictor.model`. Its embeddings have the TALKER width (codes are summed into talker inputs)."""

    def __init__(self, config: CodePredictorConfig, talker_hidden_size: int):
        c = config
        super().__init__(c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
                         c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.attention_bias, c.rope_theta)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(c.vocab_size, talker_hidden_size) for _ in range(c.num_code_groups - 1))


class CodePredictor(nn.Module):
    """`talker.code_predictor`. Step 0 sees [talker hidden, Ec(c0)] at positions 0-1; step j sees Ecp[j-1](c_j)
    at position j+1; head j predicts codebook j+1."""

    def __init__(self, config: CodePredictorConfig, talker_hidden_size: int):
        super().__init__()
        self.config = config
        self.model = CodePredictorModel(config, talker_hidden_size)
        self.lm_head = nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_code_groups - 1))
        # 1.7B: talker width 2048 -> 1024. 0.6B: equal widths, no tensor in the checkpoint.
        if config.hidden_size != talker_hidden_size:
            self.small_to_mtp_projection = nn.Linear(talker_hidden_size, config.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor) -> torch.Tensor:
        """x: [B, T, talker hidden] -> normed hidden [B, T, cp hidden]."""
        return self.model(self.small_to_mtp_projection(x), positions, cache, slots)

    def new_cache(self, num_slots: int, dtype: torch.dtype | None = None) -> KVCache:
        c, w = self.config, self.lm_head[0].weight
        return KVCache(c.num_hidden_layers, num_slots, c.num_code_groups, c.num_key_value_heads, c.head_dim,
                       dtype or w.dtype, w.device)

"""The rows' static state on the device (`RowState`: what the frame reads and writes, [max_rows, ...] each) and a
row swapped out to host memory (`SwappedRow`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sampling import SamplerTensors


class RowState:
    """Static per-row tensors ([max_rows, ...]) read and written by the frame step."""

    def __init__(self, rows: int, hidden: int, vocab: int, max_trailing: int, dtype: torch.dtype,
                 device: torch.device):
        z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt, device=device)
        self.hidden = z(rows, hidden, dt=dtype)  # normed talker hidden that predicts the next frame
        self.positions = z(rows, dt=torch.int32)  # next talker position
        self.steps = z(rows)  # codebook-0 tokens sampled so far
        self.max_new = z(rows)
        self.done = torch.ones(rows, dtype=torch.bool, device=device)
        self.emitted = z(rows, dt=torch.bool)  # the last frame step produced a frame for this row
        self.codes = z(rows, 16)  # the last frame step's codes
        self.seen = z(rows, vocab, dt=torch.bool)
        self.penalty = torch.ones(rows, device=device)
        self.seeds = z(rows)
        self.trailing_ids = z(rows, max_trailing, dt=torch.int32)
        self.trailing_len = z(rows)
        self.talker_sampler = SamplerTensors.empty(rows, device)
        self.cp_sampler = SamplerTensors.empty(rows, device)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor, the samplers' fields included."""
        out = []
        for value in vars(self).values():
            out.extend(value.tensors() if isinstance(value, SamplerTensors) else [value])
        return out


@dataclass
class SwappedRow:
    """A preempted row: its state and its KV blocks' contents, off the device's rows and cache."""

    state: list[torch.Tensor]  # RowState.tensors()[i][row], cloned on the device (small)
    k: torch.Tensor  # [layers, num_blocks, block_size, kv_heads, head_dim], in host memory
    v: torch.Tensor

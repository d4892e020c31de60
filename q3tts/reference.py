"""The reference decode loop (eager, fp32-faithful, any device): batched prefill, then one frame per step for
every active row. It is what the engine (`q3tts.engine`) is tested against, and what `TTS(reference=True)` runs.

Rows leave the batch as soon as they finish, and all per-row state (position, step, seen ids, sampling
parameters, seed) is a tensor indexed by row.
Official behaviours kept: `max_new_tokens = N` yields at most N-1 frames (the N-th sampled token is never
forwarded); EOS cannot be drawn in the first 2 steps; ids [vocab-1024, vocab) except EOS are suppressed;
the repetition penalty covers the codebook-0 ids generated so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from .engine.prompt import Prompt
from .models.talker import Talker
from .sampling import (
    MIN_NEW_TOKENS,
    SamplerTensors,
    SamplingParams,
    apply_talker_processors,
    sample,
    suppressed_ids,
)


@dataclass
class RowState:
    """Per-row decode state for a batch of B rows (all tensors are [B, ...] on the model's device)."""

    slots: torch.Tensor  # [B] KV-cache slot of each row
    positions: torch.Tensor  # [B] next talker position
    steps: torch.Tensor  # [B] decode step (number of codebook-0 tokens sampled so far)
    last_hidden: torch.Tensor  # [B, H] normed talker hidden state that predicts the next frame
    seen: torch.Tensor  # [B, V] codebook-0 ids generated so far (repetition penalty)
    penalty: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B]
    talker_sampler: SamplerTensors
    cp_sampler: SamplerTensors


@torch.no_grad()
def prefill(talker: Talker, prompts: list[Prompt], cache, slots: torch.Tensor) -> torch.Tensor:
    """Runs the prompts (right-padded; each row's positions start at 0) and returns each row's last hidden [B, H]."""
    lengths = torch.tensor([p.embeds.shape[0] for p in prompts], device=slots.device)
    x = pad_sequence([p.embeds for p in prompts], batch_first=True)
    positions = torch.arange(x.shape[1], device=slots.device).expand(len(prompts), -1)
    hidden = talker.model(x, positions, cache, slots)
    return hidden[torch.arange(len(prompts), device=slots.device), lengths - 1]


@torch.no_grad()
def predict_residual_codes(talker: Talker, cache, state: RowState, c0: torch.Tensor) -> torch.Tensor:
    """The 15-step code-predictor loop for every row: returns codebooks 1..15 as [B, 15]."""
    cp = talker.code_predictor
    B = c0.shape[0]
    rows = torch.arange(B, device=c0.device)
    x = torch.stack([state.last_hidden, talker.embed_codec(c0)], dim=1)  # [B, 2, H]
    positions = torch.arange(2, device=c0.device).expand(B, -1)
    codes = []
    for g in range(cp.config.num_code_groups - 1):
        hidden = cp(x, positions, cache, rows)[:, -1]
        logits = cp.lm_head[g](hidden).float()
        code = sample(logits, state.cp_sampler, state.seeds, state.steps * 16 + g + 1)
        codes.append(code)
        x = cp.model.codec_embedding[g](code)[:, None]
        positions = positions[:, -1:] + 1
    return torch.stack(codes, dim=1)


@torch.no_grad()
def generate_codes(talker: Talker, prompts: list[Prompt], params: list[SamplingParams],
                   on_frame: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Generates the codec frames of each prompt: a list of [T_i, 16] int64 tensors (CPU)."""
    config = talker.config
    device = talker.codec_head.weight.device
    B = len(prompts)
    max_new = torch.tensor([p.max_new_tokens for p in params], device=device)
    max_len = max(p.embeds.shape[0] for p in prompts) + int(max_new.max())
    cache = talker.new_cache(B, max_len)
    cp_cache = talker.code_predictor.new_cache(B)
    slots = torch.arange(B, device=device)
    state = RowState(
        slots=slots, positions=torch.tensor([p.embeds.shape[0] for p in prompts], device=device),
        steps=torch.zeros(B, dtype=torch.long, device=device), last_hidden=prefill(talker, prompts, cache, slots),
        seen=torch.zeros(B, config.vocab_size, dtype=torch.bool, device=device),
        penalty=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        seeds=torch.tensor([p.seed for p in params], dtype=torch.long, device=device),
        talker_sampler=SamplerTensors.build(params, False, device),
        cp_sampler=SamplerTensors.build(params, True, device))
    suppress = suppressed_ids(config.vocab_size, config.codec_eos_token_id, device)
    frames: list[list[torch.Tensor]] = [[] for _ in range(B)]
    active = torch.arange(B, device=device)
    while active.numel():
        rows = _select(state, active)
        logits = apply_talker_processors(talker.codec_head(rows.last_hidden).float(), rows.seen, rows.penalty,
                                         rows.steps, config.codec_eos_token_id, MIN_NEW_TOKENS, suppress)
        c0 = sample(logits, rows.talker_sampler, rows.seeds, rows.steps * 16)
        # A row ends on EOS, or on its N-th token, which the official loop samples but never forwards.
        done = (c0 == config.codec_eos_token_id) | (rows.steps + 1 >= max_new[active])
        keep = ~done
        active, rows, c0 = active[keep], _select(rows, keep.nonzero()[:, 0]), c0[keep]
        if not active.numel():
            break
        frame = torch.cat([c0[:, None], predict_residual_codes(talker, cp_cache, rows, c0)], dim=1)
        for i, row in enumerate(active.tolist()):
            frames[row].append(frame[i].cpu())
        x = talker.embed_frame(frame) + _trailing(prompts, active, rows.steps)
        hidden = talker.model(x[:, None], rows.positions[:, None], cache, rows.slots)[:, 0]
        state.last_hidden[active] = hidden
        state.seen[active, c0] = True
        state.positions[active] += 1
        state.steps[active] += 1
        if on_frame is not None:
            on_frame(active.numel())
    return [torch.stack(f) if f else torch.zeros(0, 16, dtype=torch.long) for f in frames]


def _select(state: RowState, rows: torch.Tensor) -> RowState:
    return RowState(slots=state.slots[rows], positions=state.positions[rows], steps=state.steps[rows],
                    last_hidden=state.last_hidden[rows], seen=state.seen[rows], penalty=state.penalty[rows],
                    seeds=state.seeds[rows], talker_sampler=state.talker_sampler.select(rows),
                    cp_sampler=state.cp_sampler.select(rows))


def _trailing(prompts: list[Prompt], rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The text embedding each row adds at this step: trailing[step], or TTS_PAD once the text is used up."""
    out = []
    for row, step in zip(rows.tolist(), steps.tolist()):
        p = prompts[row]
        out.append(p.trailing[step] if step < p.trailing.shape[0] else p.pad)
    return torch.stack(out)

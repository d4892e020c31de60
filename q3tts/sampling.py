"""Logits processing and sampling, batched with per-row parameters as tensors (no host sync, graph-safe).

The order is the official one (transformers 4.57.3 `generate` as configured by Qwen3-TTS): repetition
penalty -> min-new-tokens -> suppressed ids -> temperature -> top-k -> top-p -> softmax -> draw. Greedy rows take
the argmax of the processed logits (the penalty and masks apply to greedy decoding too).

Draws use the exponential-race form of categorical sampling, `argmax(p / E)` with `E = -log(u)`, where `u`
comes from a counter-based hash of (seed, draw counter, token id). Any path that computes the same logits
therefore draws the same tokens, on the CPU or inside a CUDA graph, and a request's seed makes it reproducible
whatever else is in the batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .config import GenerationConfig, check_generation_values, is_int
from .errors import RequestError, quote
from .transfer import to_device

_MASK32 = 0xFFFFFFFF
MIN_NEW_TOKENS = 2  # EOS cannot be drawn in the first steps (the official generate's min_new_tokens)
TOP_K_ALL = 2**31 - 1  # a top-k that keeps every token: larger values (valid) are stored as this
NUM_CONTROL_IDS = 1024  # the talker vocabulary's last ids: control tokens, never sampled except EOS


@dataclass
class SamplingParams(GenerationConfig):
    """Per-request generation parameters: the generation_config fields plus a seed (None: a random one)."""

    seed: int | None = None

    def __post_init__(self):
        check_generation_values(self)
        if self.seed is None:
            self.seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        elif not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be a non-negative integer below 2**63, got {quote(self.seed)}",
                               param="seed")


@dataclass
class SamplerTensors:
    """One sampler's parameters for a batch of rows, as device tensors: [B] each."""

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def build(cls, params: list[SamplingParams], subtalker: bool, device: torch.device | str) -> SamplerTensors:
        names = (("subtalker_dosample", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p") if subtalker
                 else ("do_sample", "temperature", "top_k", "top_p"))
        values = [[getattr(x, name) for x in params] for name in names]
        values[2] = [min(k, TOP_K_ALL) for k in values[2]]  # (any k >= the vocabulary keeps every token)
        return cls(do_sample=to_device(values[0], device, torch.bool),
                   temperature=to_device(values[1], device, torch.float32),
                   top_k=to_device(values[2], device, torch.int64),
                   top_p=to_device(values[3], device, torch.float32))

    @classmethod
    def empty(cls, num_rows: int, device: torch.device | str) -> SamplerTensors:
        """Greedy placeholders, for engine rows that hold no request."""
        return cls(do_sample=torch.zeros(num_rows, dtype=torch.bool, device=device),
                   temperature=torch.ones(num_rows, device=device),
                   top_k=torch.zeros(num_rows, dtype=torch.int64, device=device),
                   top_p=torch.ones(num_rows, device=device))

    def tensors(self) -> list[torch.Tensor]:
        return [self.do_sample, self.temperature, self.top_k, self.top_p]

    def select(self, rows: torch.Tensor) -> SamplerTensors:
        return SamplerTensors(self.do_sample[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows])

    def prefix(self, n: int) -> SamplerTensors:
        """Views of the first n rows (static addresses, for CUDA graphs)."""
        return SamplerTensors(self.do_sample[:n], self.temperature[:n], self.top_k[:n], self.top_p[:n])


def suppressed_ids(vocab_size: int, eos_id: int, device: torch.device | str) -> torch.Tensor:
    """[V] bool: the last NUM_CONTROL_IDS ids of the codec vocabulary (control tokens) except EOS."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[vocab_size - NUM_CONTROL_IDS:] = True
    mask[eos_id] = False
    return mask


def apply_talker_processors(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor, steps: torch.Tensor,
                            eos_id: int, min_new_tokens: int, suppress: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] fp32; seen: [B, V] bool (codebook-0 ids generated so far); penalty, steps: [B];
    suppress: [V] bool. Returns the processed logits (before temperature)."""
    p = penalty[:, None]
    logits = torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)
    too_early = (steps < min_new_tokens)[:, None] & (torch.arange(logits.shape[1], device=logits.device) == eos_id)
    return logits.masked_fill(too_early | suppress, float("-inf"))


def sample(logits: torch.Tensor, params: SamplerTensors, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] fp32 processed; seeds, counters: [B] int64. Returns token ids [B] (int64)."""
    greedy = logits.argmax(-1)
    scores = logits / params.temperature[:, None]
    # A temperature (or, before it, a repetition penalty) so far below 1 that the largest scores overflow to inf
    # (transformers' softmax then gives NaN and multinomial fails): their limit, the largest logits alone.
    overflowed = scores.amax(-1, keepdim=True) == float("inf")
    largest = torch.where(logits == logits.amax(-1, keepdim=True), 0.0, float("-inf"))
    scores = torch.where(overflowed, largest, scores)
    scores = _top_k(scores, params.top_k)
    scores = _top_p(scores, params.top_p)
    probs = scores.softmax(-1)
    exp_noise = -torch.log(uniform_noise(seeds, counters, logits.shape[1]))
    drawn = torch.where(probs > 0, probs / exp_noise, -1.0).argmax(-1)  # removed tokens can never win
    return torch.where(params.do_sample, drawn, greedy)


def _top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps the scores >= the k-th largest (ties kept, as transformers does); k = 0 keeps everything."""
    k = top_k.clamp(min=1, max=scores.shape[1])
    kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    kth = torch.where((top_k > 0)[:, None], kth, torch.full_like(kth, float("-inf")))
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - top_p, keep at least one."""
    sorted_scores, order = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(-1).cumsum(-1)
    remove_sorted = cumulative <= (1 - top_p)[:, None]
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    # top_p = 1 is "off" in transformers; skipping it also keeps tokens whose cumulative mass rounds to 0.
    remove &= (top_p < 1.0)[:, None]
    return scores.masked_fill(remove, float("-inf"))


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """u in (0, 1): [B, n] float32, a pure function of (seed, counter, column). Integer ops only, so it is the
    same on every device; 32-bit mixing in int64 keeps every product below 2^63 (no overflow). 23 bits, so
    that u stays strictly below 1 in float32 (24 bits would round the top value to 1.0, and -log(1) = 0)."""
    col = torch.arange(n, device=seeds.device, dtype=torch.int64)[None, :]
    h = _mix32((counters[:, None] & _MASK32) ^ _mix32(col + 0x3C6EF372))
    h = _mix32(h ^ (seeds[:, None] & _MASK32))
    h = _mix32(h ^ ((seeds[:, None] >> 32) & _MASK32) ^ 0x1B873593)
    return ((h >> 9).float() + 0.5) / float(1 << 23)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)

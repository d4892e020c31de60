"""Admitting rows (`Prefill`, a part of `ModelRunner`): a burst's prompts prefilled together through the talker
(padded to a captured prefill bucket, or eagerly beyond the largest), a voice's cached prefix copied in instead of
prefilled (prefix_cache.py), and each new row's state armed from the host in one transfer."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ...sampling import TOP_K_ALL, SamplingParams
from ...transfer import host_tensor, row_slice, to_device, to_device_together, zero_rows
from ..kv_blocks import OutOfBlocks
from ..prompt import Prompt
from .graphs import replay_or_run


class Prefill:
    """Prefill and row admission; mixed into `ModelRunner` (its static prefill buffers, `talker`, `cache`, `kv`,
    `prefix_cache` and `state`)."""

    @torch.no_grad()
    def add_rows(self, rows: list[int], prompts: list[Prompt], params: list[SamplingParams]) -> None:
        """Prefills `prompts` into the empty `rows` and arms them. Each row gets the KV blocks of its prompt and
        first frame (`grow` adds the rest as it runs); raises OutOfBlocks, changing nothing, if they are not
        free."""
        dev = self.device
        lengths = [p.num_positions for p in prompts]
        need = sum(self.kv.blocks_for(n + 1) for n in lengths)
        if need > self.kv.num_free:
            raise OutOfBlocks(f"{need} KV blocks needed for the prompts, {self.kv.num_free} free")
        self.grow_rows(rows, [n + 1 for n in lengths])
        starts, store = self._reuse_prefixes(rows, prompts)
        pieces = [piece.to(dev) for p, start in zip(prompts, starts) for piece in p.embeds_from(start)]
        hidden = self._prefill_tokens(rows, starts, lengths, pieces)
        if store:  # computed just now: kept for the next request with this voice
            self._keep_prefixes(store)
        self._arm_rows(rows, prompts, params, hidden, [n - a for n, a in zip(lengths, starts)])

    def _arm_rows(self, rows: list[int], prompts: list[Prompt], params: list[SamplingParams], hidden: torch.Tensor,
                  counts: list[int]) -> None:
        """Each new row's state: its prompt's last hidden state (`hidden` holds `counts[i]` tokens of row i, in
        order), its counters, limits, sampling settings and trailing text, from the host in one transfer and one
        multi-tensor copy per dtype (a burst's rows together; ~40 small copies and launches before)."""
        s = self.state
        samplers = [s.talker_sampler, s.cp_sampler]
        targets = [[s.steps, s.max_new, s.seeds, s.trailing_len, *(x.top_k for x in samplers)],  # int64 (and `last`)
                   [s.penalty, *(t for x in samplers for t in (x.temperature, x.top_p))],  # float32
                   [s.done, s.emitted, *(x.do_sample for x in samplers)], [s.positions]]  # bool, int32
        int64, *others, trailing = to_device_together(_row_values(prompts, params, counts), self.device)
        *counters, last = int64.unbind(0)
        values = [counters, *(t.unbind(0) for t in others)]
        run = row_slice(rows)
        index = run if run else to_device(rows, self.device)
        for group, group_values in zip(targets, values):  # (a dtype each)
            if run:
                torch._foreach_copy_([t[run] for t in group], list(group_values))
            else:
                for t, v in zip(group, group_values):
                    t[index] = v
        s.hidden[index] = hidden[last]
        zero_rows([s.seen], rows)
        if trailing.shape[1]:
            s.trailing_ids[index, :trailing.shape[1]] = trailing

    def prefill_tokens(self, prompt: Prompt) -> int:
        """The positions `add_rows` would prefill for `prompt` now (its cached prefix, if any, is copied)."""
        cached = self.prefix_cache is not None and prompt.prefix_key in self.prefix_cache.entries
        return prompt.num_positions - (prompt.prefix_len if cached else 0)

    def _reuse_prefixes(self, rows: list[int], prompts: list[Prompt]) -> tuple[list[int], list]:
        """Copies the cached keys and values of each prompt's voice prefix into its row (all rows in one scatter).
        Returns the position each row's prefill starts at, and the (row, prompt) whose prefix should be kept once
        prefilled."""
        starts, store, hits = [0] * len(rows), [], []
        if self.prefix_cache is None:
            return starts, store
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            if not prompt.prefix_key or prompt.prefix_len < 1:
                continue
            hit = self.prefix_cache.get(prompt.prefix_key)
            if hit is None:
                if all(p.prefix_key != prompt.prefix_key for _, p in store) and self.prefix_cache.wants(
                        prompt.prefix_key, prompt.prefix_len * self.kv_bytes_per_block // self.config.block_size):
                    store.append((row, prompt))
                continue
            hits.append((row, *hit))
            starts[i] = prompt.prefix_len
        if hits:
            blocks, offsets = self._kv_slots([(row, k.shape[1]) for row, k, _ in hits])
            self.cache.k[:, blocks, offsets] = torch.cat([k for _, k, _ in hits], dim=1)
            self.cache.v[:, blocks, offsets] = torch.cat([v for _, _, v in hits], dim=1)
        return starts, store

    def _kv_slots(self, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) in the paged cache of positions 0..n-1 of each (row, n), one after the other."""
        bs = self.config.block_size
        blocks, offsets = [], []
        for row, n in spans:  # (Python lists: a burst's 64 rows took ~5 small torch calls each)
            blocks += [block for block in self.kv.rows[row][:-(-n // bs)] for _ in range(bs)][:n]
            offsets += [p % bs for p in range(n)]
        slots = to_device(host_tensor([blocks, offsets], torch.int64), self.device)
        return slots[0], slots[1]

    def _keep_prefixes(self, store: list[tuple[int, Prompt]]) -> None:
        """Copies each (row, prompt)'s prefix keys and values into the prefix cache: one gather for all of them,
        the entries views of it (the cache counts its storage once)."""
        sizes = [prompt.prefix_len for _, prompt in store]
        blocks, offsets = self._kv_slots([(row, n) for (row, _), n in zip(store, sizes)])
        k, v = self.cache.k[:, blocks, offsets], self.cache.v[:, blocks, offsets]  # (copies)
        for (_, prompt), k_part, v_part in zip(store, k.split(sizes, 1), v.split(sizes, 1)):
            self.prefix_cache.put(prompt.prefix_key, k_part, v_part)

    def _prefill_tokens(self, rows: list[int], starts: list[int], lengths: list[int], pieces: list[torch.Tensor]
                        ) -> torch.Tensor:
        """Runs the prompts' tokens (rows[i] gets positions starts[i]..lengths[i]-1, those before already in its
        KV; their embeddings: `pieces`, joined in order) through the talker and returns their normed hidden states
        [N, H]. Up to the largest prefill bucket the tokens are padded to a bucket (padding tokens go to the
        scratch row) and the captured graph runs; beyond it, eagerly."""
        N, dev = sum(piece.shape[0] for piece in pieces), self.device
        # Each token's row and position (Python lists: a burst's 64 prompts took ~70 small torch calls)
        flat_rows = [row for row, a, n in zip(rows, starts, lengths) for _ in range(a, n)]
        flat_pos = [p for a, n in zip(starts, lengths) for p in range(a, n)]
        bucket = next((b for b in self.config.prefill_buckets if b >= N), None)
        if bucket is None:
            where = to_device(host_tensor([flat_rows, flat_pos], torch.int32), dev)
            return self.talker(torch.cat(pieces), where[0], where[1], self.cache)
        pad = bucket - N
        torch.cat([piece.to(self.prefill_x.dtype) for piece in pieces], out=self.prefill_x[:N])
        where = host_tensor([flat_rows + [self.config.max_rows] * pad, flat_pos + [0] * pad], torch.int32)
        where = to_device(where, dev)
        self.prefill_rows[:bucket].copy_(where[0])
        self.prefill_positions[:bucket].copy_(where[1])
        replay_or_run(self.prefill_graphs, self.prefill, bucket)
        return self.prefill_out[:N]

    def prefill(self, bucket: int) -> None:
        """The prefill phase over its static buffers' first `bucket` tokens (what a prefill graph replays)."""
        self.prefill_out[:bucket] = self.talker(self.prefill_x[:bucket], self.prefill_rows[:bucket],
                                                self.prefill_positions[:bucket], self.cache)


def _row_values(prompts: list[Prompt], params: list[SamplingParams], counts: list[int]) -> list[torch.Tensor]:
    """`ModelRunner._arm_rows`' host values, a tensor per dtype (int64 [7, n]: steps, max_new_tokens, seeds, trailing
    lengths, the two top-ks and each row's last prefill token; float32 [5, n]: the penalty, the two temperatures and
    top-ps; bool [4, n]: done, emitted, the two do_samples; int32 [1, n]: positions) and the trailing text [n, T]."""
    n, text = len(prompts), max(len(p.trailing_ids) for p in prompts)
    trailing = np.zeros((n, text), dtype=np.int32)
    for i, p in enumerate(prompts):
        trailing[i, :len(p.trailing_ids)] = p.trailing_ids
    top_k = ([min(getattr(q, name), TOP_K_ALL) for q in params] for name in ("top_k", "subtalker_top_k"))
    int64 = [[0] * n, [q.max_new_tokens for q in params], [q.seed for q in params],
             [len(p.trailing_ids) for p in prompts], *top_k, [k - 1 for k in itertools.accumulate(counts)]]
    float32 = [[getattr(q, name) for q in params] for name in ("repetition_penalty", "temperature", "top_p",
                                                                "subtalker_temperature", "subtalker_top_p")]
    flags = [[False] * n, [False] * n, *([bool(getattr(q, name)) for q in params]
                                         for name in ("do_sample", "subtalker_dosample"))]
    return [host_tensor(int64, torch.int64), host_tensor(float32, torch.float32), host_tensor(flags, torch.bool),
            host_tensor([[p.num_positions for p in prompts]], torch.int32), torch.from_numpy(trailing)]

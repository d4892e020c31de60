"""The model runner: owns every device tensor of the fast decode path and runs one frame for all rows.

Rows 0..B-1 of the static state are the running sequences (the engine keeps them compact). One frame =
sample codebook 0 from each row's last talker hidden state, run the whole 15-step code predictor with its
sampling, and feed the frame back through the talker. On CUDA the frame is captured as one graph per batch
bucket at start-up (largest first, one memory pool); padding rows of a bucket are finished rows that write
only to the scratch KV block 0. Nothing in the frame reads back to the host: EOS and length limits set `done`
on the device, and the host collects codes through pinned buffers and events, one frame behind.

The talker's KV cache is paged (`kv_blocks.KVBlocks` says which blocks each row holds); a row grows a block at
a time as it runs (`grow`). A row can be swapped out to host memory (`swap_out`) and back into any free row
(`swap_in`) unchanged: that is how the engine preempts a row when the cache is full.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels.linear import fused_linear
from ...kernels.norm import add_rmsnorm
from ...kernels.sampler import TalkerProcessors, sample_tokens
from ...models.qwen3_tts import Qwen3TTSModel
from ...sampling import MIN_NEW_TOKENS, TOP_K_ALL, SamplerTensors, SamplingParams, suppressed_ids
from ...transfer import RowViews, row_slice, set_row, to_device, to_device_together, zero_rows
from ..config import EngineConfig
from ..kv_blocks import KVBlocks, OutOfBlocks
from ..prompt import Prompt
from .graphs import capture_buckets, replay_or_run, side_stream
from .prefix_cache import PrefixCache
from .transformer import FlatDecoder, PagedCache

# Calls of these many tokens keep cuBLAS in a talker wider than 1,024 (1.7B's): see ModelRunner.__init__
WIDE_TALKER_UNFUSED_ROWS = (2,)


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


class ModelRunner:
    def __init__(self, model: Qwen3TTSModel, config: EngineConfig | None = None, kv_blocks: int | None = None):
        """kv_blocks: the KV cache's size (default: the config's, without a GPU memory budget; the engine sizes
        it from its budget with `allocate_kv_cache`)."""
        self.model, self.config = model, config or EngineConfig()
        cfg = self.config
        talker = model.talker
        tc, cc = talker.config, talker.code_predictor.config
        self.device = talker.codec_head.weight.device
        self.dtype = talker.codec_head.weight.dtype
        self.max_context = cfg.context_for(tc.max_position_embeddings)
        # The matrix-vector kernel at two rows is slower than cuBLAS for 1.7B's talker (2,048 wide), not for 0.6B's
        # (docs/perf-notes.md, entries 51 and 69: 1.77 -> 1.95 ms): the wider talker keeps cuBLAS there.
        self.talker = FlatDecoder(talker.model.layers, talker.model.norm.weight, tc.rms_norm_eps,
                                  tc.num_attention_heads, tc.head_dim, talker.model.inv_freq,
                                  unfused_rows=WIDE_TALKER_UNFUSED_ROWS if tc.hidden_size > 1024 else ())
        cp = talker.code_predictor
        self.cp = FlatDecoder(cp.model.layers, cp.model.norm.weight, cc.rms_norm_eps, cc.num_attention_heads,
                              cc.head_dim, cp.model.inv_freq)
        # The code predictor's 16 positions per frame: one block per row, block r for row r.
        self.cp_cache = PagedCache.allocate(cc.num_hidden_layers, cfg.max_rows, cc.num_code_groups,
                                            cc.num_key_value_heads, cc.head_dim, cfg.max_rows, 1, self.dtype,
                                            self.device)
        self.cp_cache.block_table.copy_(torch.arange(cfg.max_rows, device=self.device, dtype=torch.int32)[:, None])
        self.state = RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing, self.dtype,
                              self.device)
        self.suppress = suppressed_ids(tc.vocab_size, tc.codec_eos_token_id, self.device)
        self.row_ids = torch.arange(cfg.max_rows, device=self.device, dtype=torch.int32)
        self.cp_first = (torch.arange(2 * cfg.max_rows, device=self.device, dtype=torch.int32) // 2,
                         torch.arange(2 * cfg.max_rows, device=self.device, dtype=torch.int32) % 2)
        self.cp_positions = torch.arange(cc.num_code_groups, device=self.device, dtype=torch.int32)[:, None].expand(
            -1, cfg.max_rows).contiguous()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        n = max(cfg.prefill_buckets, default=0)
        self.prefill_x = torch.zeros(n, tc.hidden_size, dtype=self.dtype, device=self.device)
        self.prefill_rows = torch.full((n,), cfg.max_rows, dtype=torch.int32, device=self.device)
        self.prefill_positions = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.prefill_out = torch.zeros(n, tc.hidden_size, dtype=self.dtype, device=self.device)
        self._head_out_dtype = _probe_fp32_head(self.device, self.dtype)
        # How the decode steps run (EngineConfig.fused_decode); the fused products keep fp32 on cuBLAS, whose sums
        # the reference loop shares.
        self._decode = {"decode": cfg.fused_decode != "off",
                        "fused": cfg.fused_decode == "all" and self.dtype != torch.float32}
        # On the fused path a narrower code predictor's input projection (1.7B: 2,048 -> 1,024 with bias) is looked up
        # instead of run: the projected embedding rows of its codebooks 1-14, computed once (the sampler gathers
        # them; the same products, summed in another order). The fp32 and unfused paths run it as the reference.
        self.cp_input_tables = self._project_cp_inputs() if self._decode["fused"] else None
        # Likewise the code predictor's first layer (input norm, qkv product) over those inputs: its decode steps
        # look their qkv up (docs/perf-notes.md, entry 90). Not on a CPU, where computing the tables (~240 GFLOP)
        # costs what ~30,000 one-row steps save.
        self.cp_qkv_tables = self._cp_qkv_tables() if self._decode["fused"] and self.device.type == "cuda" else None
        self.cache: PagedCache | None = None
        self._rows: RowViews | None = None  # the rows' views (remove_rows), made once
        self._padding: RowViews | None = None
        self.allocate_kv_cache(kv_blocks or cfg.kv_blocks(self.kv_bytes_per_block, self.max_context, None))
        self.prefix_cache = PrefixCache(int(cfg.prefix_cache_gb * 2**30)) if cfg.prefix_cache_gb else None

    @torch.no_grad()
    def _project_cp_inputs(self) -> list[torch.Tensor] | None:
        """cp_input_tables: codebooks 1-14's embedding rows through the code predictor's input projection (None
        where it has none)."""
        cp = self.model.talker.code_predictor
        if not isinstance(cp.small_to_mtp_projection, torch.nn.Linear):
            return None
        return [cp.small_to_mtp_projection(e.weight).contiguous() for e in cp.model.codec_embedding[:-1]]

    @torch.no_grad()
    def _cp_qkv_tables(self) -> list[torch.Tensor]:
        """cp_qkv_tables: the code predictor's first qkv product (input norm, then the product: the kernels of its
        64-row steps) of each of its decode inputs, codebooks 1-14's embedding rows (projected where it projects):
        14 x [2,048, 4,096] (235 MB in bf16 at the real sizes)."""
        first = self.cp.layers[0]
        inputs = self.cp_input_tables or [e.weight for e in self.model.talker.code_predictor.model.codec_embedding[:-1]]
        return [F.linear(add_rmsnorm(x, None, first.input_norm, self.cp.eps, self.dtype)[0], first.qkv)
                for x in inputs]

    @property
    def kv_bytes_per_block(self) -> int:
        tc = self.model.talker.config
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * tc.num_hidden_layers * self.config.block_size * tc.num_key_value_heads * tc.head_dim * itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)allocates the talker's paged KV cache with `num_blocks` blocks (block 0 is scratch), before graphs
        are captured and with no rows admitted. Row max_rows of the block table is a scratch row (all blocks ->
        block 0) for the padding tokens of a bucketed prefill."""
        cfg, tc = self.config, self.model.talker.config
        self.cache = self._rows = self._padding = None  # free the old cache before allocating the new one
        blocks_per_row = -(-self.max_context // cfg.block_size)
        self.cache = PagedCache.allocate(tc.num_hidden_layers, num_blocks, cfg.block_size, tc.num_key_value_heads,
                                         tc.head_dim, cfg.max_rows + 1, blocks_per_row, self.dtype, self.device)
        self.kv = KVBlocks(num_blocks, cfg.block_size, cfg.max_rows)

    # ---- rows ---------------------------------------------------------------------------------------------

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

    def grow(self, row: int, num_positions: int) -> None:
        """Makes `row` hold KV for at least `num_positions` positions (OutOfBlocks if too few blocks are free)."""
        self.grow_rows([row], [num_positions])

    def grow_rows(self, rows: list[int], num_positions: list[int]) -> None:
        """`grow` for each row, with one write of the block table; on OutOfBlocks the rows before the one that
        failed keep their new blocks."""
        cells: tuple[list[int], list[int], list[int]] = ([], [], [])  # row, index in its table, block
        try:
            for row, n in zip(rows, num_positions):
                start, new = self.kv.grow(row, n)
                cells[0].extend([row] * len(new))
                cells[1].extend(range(start, start + len(new)))
                cells[2].extend(new)
        finally:
            if cells[0]:
                where = to_device(torch.tensor(cells, dtype=torch.int32), self.device)
                self.cache.block_table[where[0], where[1]] = where[2]

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
                if all(p.prefix_key != prompt.prefix_key for _, p in store):
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
        slots = to_device(torch.tensor([blocks, offsets]), self.device)
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
            where = to_device(torch.tensor([flat_rows, flat_pos], dtype=torch.int32), dev)
            return self.talker(torch.cat(pieces), where[0], where[1], self.cache)
        pad = bucket - N
        torch.cat([piece.to(self.prefill_x.dtype) for piece in pieces], out=self.prefill_x[:N])
        where = torch.tensor([flat_rows + [self.config.max_rows] * pad, flat_pos + [0] * pad], dtype=torch.int32)
        where = to_device(where, dev)
        self.prefill_rows[:bucket].copy_(where[0])
        self.prefill_positions[:bucket].copy_(where[1])
        replay_or_run(self.prefill_graphs, self.prefill, bucket)
        return self.prefill_out[:N]

    def prefill(self, bucket: int) -> None:
        """The prefill phase over its static buffers' first `bucket` tokens (what a prefill graph replays)."""
        self.prefill_out[:bucket] = self.talker(self.prefill_x[:bucket], self.prefill_rows[:bucket],
                                                self.prefill_positions[:bucket], self.cache)

    def release_rows(self, rows: list[int]) -> None:
        """Frees the rows' KV blocks; the rows become padding (finished, scratch block)."""
        for row in rows:
            self.kv.release(row)
        self._make_padding(rows)

    def _make_padding(self, rows: list[int]) -> None:
        """Rows that hold no request: finished, pointing at the scratch block."""
        run = row_slice(rows)  # (fill_ / index_fill_: `t[index] = True` would copy a host scalar, synchronizing)
        if run:
            zero_rows([self.cache.block_table, self.state.positions], rows)
            self.state.done[run] = True
        else:
            self._padding_views().zero(rows)
            self.state.done.index_fill_(0, to_device(rows, self.device), True)

    def _padding_views(self) -> RowViews:
        if self._padding is None:
            self._padding = RowViews([self.cache.block_table, self.state.positions])
        return self._padding

    def remove_rows(self, released: list[int], moves: list[tuple[int, int]]) -> None:
        """Frees the KV blocks of the rows `released` (in order), then moves the sequence in row src to the free row
        dst for each (src, dst) (between frames, device copies only: one launch per dtype for all of them); the rows
        left empty become padding (the engine's compaction leaves them after the running rows: one slice)."""
        for row in released:
            self.kv.release(row)
        if moves:
            if self._rows is None:  # (the rows' views: made once the cache is allocated)
                self._rows = RowViews([*self.state.tensors(), self.cache.block_table])
            self._rows.copy(moves)
            for src, dst in moves:
                self.kv.move(src, dst)
        empty = {*released, *(src for src, _ in moves)} - {dst for _, dst in moves}
        if empty:
            self._make_padding(sorted(empty))

    def move_row(self, src: int, dst: int) -> None:
        """Moves the sequence in row `src` to the free row `dst`, so the running rows stay 0..B-1; `src` becomes a
        padding row."""
        self.remove_rows([], [(src, dst)])

    def swap_out(self, row: int) -> SwappedRow:
        """Copies the row's state and KV blocks off the device's rows and cache and frees them (the row becomes
        padding). The copies run in stream order, so the next frame may reuse the blocks."""
        blocks = to_device(self.kv.rows[row], self.device)
        host = (lambda t: t.to("cpu", non_blocking=True)) if self.device.type == "cuda" else (lambda t: t)
        swapped = SwappedRow(state=[t[row].clone() for t in self.state.tensors()],
                             k=host(self.cache.k[:, blocks]), v=host(self.cache.v[:, blocks]))
        self.release_rows([row])
        return swapped

    def swap_in(self, row: int, swapped: SwappedRow) -> None:
        """Restores a swapped-out sequence into the empty `row` (OutOfBlocks, changing nothing, if its blocks
        are not free)."""
        self.grow(row, swapped.k.shape[1] * self.config.block_size)
        blocks = to_device(self.kv.rows[row], self.device)
        self.cache.k[:, blocks] = to_device(swapped.k, self.device)
        self.cache.v[:, blocks] = to_device(swapped.v, self.device)
        set_row(self.state.tensors(), row, swapped.state)

    def park(self, row: int) -> tuple[list[torch.Tensor], list[int]]:
        """Takes a live row off the batch (engine/live.py): returns its state (cloned, on the device) and its KV
        blocks, which it keeps; the row becomes padding."""
        state = [t[row].clone() for t in self.state.tensors()]
        blocks = self.kv.detach(row)
        self._make_padding([row])
        return state, blocks

    def unpark(self, row: int, state: list[torch.Tensor], blocks: list[int]) -> None:
        """Puts a parked row back into the empty `row`, unchanged."""
        self.kv.attach(row, blocks)
        if blocks:
            self.cache.block_table[row, :len(blocks)] = to_device(blocks, self.device, torch.int32)
        set_row(self.state.tensors(), row, state)

    def swap_out_parked(self, state: list[torch.Tensor], blocks: list[int]) -> SwappedRow:
        """A parked row preempted: its KV blocks' contents to host memory (as `swap_out`), the blocks freed."""
        where = to_device(blocks, self.device)
        host = (lambda t: t.to("cpu", non_blocking=True)) if self.device.type == "cuda" else (lambda t: t)
        swapped = SwappedRow(state=state, k=host(self.cache.k[:, where]), v=host(self.cache.v[:, where]))
        self.kv.release_blocks(blocks)
        return swapped

    def set_trailing(self, row: int, start: int, ids: list[int]) -> None:
        """Writes a live row's trailing text ids `start..` (arrived since) and its trailing length."""
        s = self.state
        s.trailing_ids[row, start:start + len(ids)] = to_device(ids, self.device, torch.int32)
        s.trailing_len[row] = start + len(ids)

    # ---- the frame -------------------------------------------------------------------------------------------

    def bucket(self, num_rows: int) -> int:
        """The captured batch size that serves `num_rows` rows (exactly `num_rows` when running eagerly)."""
        if not self.graphs:
            return num_rows
        return next(b for b in self.config.buckets if b >= num_rows)

    @torch.no_grad()
    def step(self, num_rows: int) -> None:
        """One frame for rows 0..num_rows-1 (the padding rows of the bucket run too, harmlessly)."""
        replay_or_run(self.graphs, self.frame, self.bucket(num_rows))

    @torch.no_grad()
    def capture_graphs(self, stream: torch.cuda.Stream | None = None) -> None:
        """Captures every bucket, largest first, into one memory pool, on `stream` (default: a side stream; see
        graphs.py). Call after `allocate_kv_cache` and before admitting any row."""
        if self.device.type != "cuda" or not self.config.use_graphs:
            return
        stream = stream or side_stream()
        self.graphs = capture_buckets(self.frame, self.config.buckets, stream)
        self.prefill_graphs = capture_buckets(self.prefill, self.config.prefill_buckets, stream)
        self.reset_state()

    def reset_state(self) -> None:
        """Every row back to padding (after graph capture or memory profiling ran frames on the static state)."""
        cfg, tc = self.config, self.model.talker.config
        self.state = _copy_into(self.state, RowState(cfg.max_rows, tc.hidden_size, tc.vocab_size, cfg.max_trailing,
                                                     self.dtype, self.device))

    def _head(self, hidden: torch.Tensor, weight: torch.Tensor,
              norm: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """fp32 logits of `hidden` (normed) through `weight`; with `norm` (weight, sums of squares or None), `hidden`
        is the code predictor's residual stream before its final norm, which the product applies
        (`_code_predictor`)."""
        if norm is not None:
            return fused_linear(hidden, weight, norm=norm[0], squares=norm[1], eps=self.cp.eps, fp32_out=True,
                                        pdl=hidden.shape[0] == 1)
        if self._head_out_dtype:
            if self.talker.fuses(hidden.shape[0], self._decode["fused"]):
                return fused_linear(hidden, weight, fp32_out=True)
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return F.linear(hidden, weight).float()

    def frame(self, B: int) -> None:
        """One frame of the first B rows (what a frame graph replays), in its four phases, each public for the
        benchmarks' per-phase timings: `frame_inputs`, `sample_codebook0`, `predict_residual_codes`, `talker_step`."""
        embeds, counters = self.frame_inputs(B)
        c0 = self.sample_codebook0(B, counters, embeds[0])
        codes = self.predict_residual_codes(B, c0, counters, embeds)
        self.talker_step(B, c0, codes, frame_sum(embeds))

    def frame_inputs(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The frame's buffer for its 16 codes' embedding rows [16, B, H] (each gathered by the draw of its code)
        and its draws' noise counters (these + the codebook)."""
        embeds = torch.empty(16, B, self.model.talker.config.hidden_size, dtype=self.dtype, device=self.device)
        return embeds, self.state.steps[:B] * 16

    def sample_codebook0(self, B: int, counters: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Codebook 0's codes, their embedding rows into `embed`."""
        s, talker = self.state, self.model.talker
        tc = talker.config
        procs = TalkerProcessors(s.seen[:B], s.penalty[:B], s.steps[:B], self.suppress, tc.codec_eos_token_id,
                                 MIN_NEW_TOKENS)
        return sample_tokens(self._head(s.hidden[:B], talker.codec_head.weight), s.talker_sampler.prefix(B),
                             s.seeds[:B], counters, procs, gather=[(talker.model.codec_embedding.weight, embed)])

    def predict_residual_codes(self, B: int, c0: torch.Tensor, counters: torch.Tensor,
                                embeds: torch.Tensor) -> list[torch.Tensor]:
        """The 15 code-predictor steps with their sampling; returns the 16 codes, their embedding rows in
        `embeds` [16, B, H] (embeds[0]: codebook 0's, given)."""
        s, cp = self.state, self.model.talker.code_predictor
        seeds, sampler = s.seeds[:B], s.cp_sampler.prefix(B)
        # Positions 0 and 1 (talker hidden, Ec(c0)) in one pass, then one position per code.
        x = torch.stack([s.hidden[:B], embeds[0]], dim=1).view(2 * B, -1)
        h, norm = self._code_predictor(x, self.cp_first[0][: 2 * B], self.cp_first[1][: 2 * B], decode=False,
                                       keep=slice(1, None, 2), pairs=True)
        logits = self._head(h, cp.lm_head[0].weight, norm)
        codes = [c0]
        for g in range(cp.config.num_code_groups - 1):
            gather, x, step = self.cp_gather(g, embeds)
            codes.append(sample_tokens(logits, sampler, seeds, counters, offset=g + 1, gather=gather))
            if g < cp.config.num_code_groups - 2:
                logits = self._cp_logits(x, self.row_ids[:B], self.cp_positions[g + 2, :B], cp.lm_head[g + 1].weight,
                                         **step)
        return codes

    def cp_gather(self, g: int, embeds: torch.Tensor) -> tuple[list, torch.Tensor, dict]:
        """What the code predictor's draw g gathers (sample_tokens' `gather`) and what its next step takes: the
        code's embedding row into embeds[g + 1]; but for the last draw, with cp_input_tables the next step's input
        projected into a buffer of its own, with cp_qkv_tables that input's first qkv product into another ->
        (gather, the next step's input, _code_predictor's keywords for it)."""
        cp = self.model.talker.code_predictor
        gather = [(cp.model.codec_embedding[g].weight, embeds[g + 1])]
        x, step = embeds[g + 1], {}
        if g == cp.config.num_code_groups - 2:
            return gather, x, step

        def into_buffer(table: torch.Tensor) -> torch.Tensor:
            gather.append((table, torch.empty(embeds.shape[1], table.shape[1], dtype=self.dtype, device=self.device)))
            return gather[-1][1]

        if self.cp_input_tables is not None:
            x, step["projected"] = into_buffer(self.cp_input_tables[g]), True
        if self.cp_qkv_tables is not None:
            step["qkv0"] = into_buffer(self.cp_qkv_tables[g])
        return gather, x, step

    def _cp_logits(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, head: torch.Tensor,
                   projected: bool = False, qkv0: torch.Tensor | None = None) -> torch.Tensor:
        """A code-predictor decode step over x (as _code_predictor) and its logits through `head` in fp32: on the
        layer tail with the head the last phase of the step's last launch where the tail takes the step
        (docs/perf-notes.md, entry 98), else the decoder's other kernels, then _head."""
        if not projected:
            x = self.model.talker.code_predictor.small_to_mtp_projection(x)
        if self._decode["decode"] and not self.cp.fuses(x.shape[0], self._decode["fused"]):
            logits = self.cp.decode_logits(x, rows, positions, self.cp_cache, head, qkv0)
            if logits is not None:
                return logits
        h, norm = self._code_predictor(x, rows, positions, projected=True, qkv0=qkv0)
        return self._head(h, head, norm)

    def _code_predictor(self, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, decode: bool = True,
                        keep: slice = slice(None), projected: bool = False, qkv0: torch.Tensor | None = None,
                        pairs: bool = False) -> tuple[torch.Tensor, tuple | None]:
        """The code predictor over x (talker width, or its own with `projected`: looked up in cp_input_tables; with
        `qkv0` its first qkv product, looked up in cp_qkv_tables; `pairs`: its first pass, each row's positions 0
        and 1), the tokens `keep` of its output -> (h, None) with h normed, or on the fused products (residual
        stream, (final norm, its sums of squares or None)): the heads' products apply the norm."""
        if not projected:
            x = self.model.talker.code_predictor.small_to_mtp_projection(x)
        fused = self._decode["fused"]
        decode, pairs = decode and self._decode["decode"], pairs and self._decode["decode"]
        if self.cp.fuses(x.shape[0], fused):
            h, squares = self.cp(x, rows, positions, self.cp_cache, decode, fused, final_norm=False, qkv0=qkv0,
                                 pairs=pairs)
            return h[keep], (self.cp.final_norm, None if squares is None else squares[:, keep])
        return self.cp(x, rows, positions, self.cp_cache, decode, fused, qkv0=qkv0, pairs=pairs)[keep], None

    def talker_step(self, B: int, c0: torch.Tensor, codes: list[torch.Tensor], frame: torch.Tensor) -> None:
        """Feeds the frame plus this step's trailing text (TTS_PAD once used up) and updates the row state."""
        s, talker = self.state, self.model.talker
        steps = s.steps[:B]
        in_text = steps < s.trailing_len[:B]
        text_id = s.trailing_ids[:B].gather(1, steps.clamp(max=s.trailing_ids.shape[1] - 1)[:, None])[:, 0]
        text_id = torch.where(in_text, text_id, self.model.config.tts_pad_token_id)
        x = frame + talker.embed_text(text_id).float()
        new_hidden = self.talker(x, self.row_ids[:B], s.positions[:B], self.cache,
                                 **self._decode)
        finished = (c0 == talker.config.codec_eos_token_id) | (steps + 1 >= s.max_new[:B])
        s.emitted[:B] = ~s.done[:B] & ~finished
        s.done[:B] |= finished
        # A finished row's frame is never emitted; its EOS id (beyond the codebook) must not reach the codec.
        codes[0] = torch.where(finished, 0, c0)
        s.codes[:B] = torch.stack(codes, dim=1)
        s.hidden[:B] = new_hidden
        s.positions[:B] += (~s.done[:B]).int()
        s.steps[:B] += 1

    @torch.no_grad()
    def teacher_forced_logits(self, prompt: Prompt, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fast path's raw logits for a fixed history, computed as generation computes them (the prompt's
        prefill, then one decode step per frame for the talker and per code for the code predictor, with the
        engine's kernels and settings): talker [T + 1, V] and code predictor [T, 15, 2048], as
        q3tts.teacher_forcing returns them. Uses row 0 of the talker cache and the code predictor's rows: call
        with no rows admitted."""
        talker, cp = self.model.talker, self.model.talker.code_predictor
        codes = codes.to(self.device)
        T, L = codes.shape[0], prompt.embeds.shape[0]
        embeds = [talker.model.codec_embedding(codes[:, 0])]
        embeds += [cp.model.codec_embedding[g](codes[:, g + 1]) for g in range(cp.config.num_code_groups - 1)]
        frame = frame_sum(torch.stack(embeds))
        trailing = torch.tensor(prompt.trailing_ids + [self.model.config.tts_pad_token_id] * T, device=self.device)
        steps = frame + talker.embed_text(trailing[:T]).float()
        if L + T > self.max_context:
            raise ValueError(f"{L + T} positions exceed the engine's max_context {self.max_context}")
        self.grow(0, L + T)
        positions = torch.arange(L + T, device=self.device, dtype=torch.int32)
        hidden = [self.talker(prompt.embeds.to(self.device).float(), torch.zeros_like(positions[:L]), positions[:L],
                              self.cache)[-1:]]
        for t in range(T):
            hidden.append(self.talker(steps[t:t + 1], self.row_ids[:1], positions[L + t:L + t + 1], self.cache,
                                      **self._decode))
        self.release_rows([0])
        hidden = torch.cat(hidden)
        talker_logits = self._head(hidden, talker.codec_head.weight)
        cp_logits = []
        for t in range(T):  # one frame at a time, as a single stream's code predictor runs
            x = torch.stack([hidden[t:t + 1], embeds[0][t:t + 1]], dim=1).view(2, -1)
            h, norm = self._code_predictor(x, self.cp_first[0][:2], self.cp_first[1][:2], decode=False,
                                           keep=slice(1, None, 2), pairs=True)
            logits = [self._head(h, cp.lm_head[0].weight, norm)]
            for g in range(cp.config.num_code_groups - 2):
                tables, code = self.cp_input_tables, codes[t:t + 1, g + 1]
                x = embeds[g + 1][t:t + 1] if tables is None else tables[g][code]
                qkv0 = None if self.cp_qkv_tables is None else self.cp_qkv_tables[g][code]
                logits.append(self._cp_logits(x, self.row_ids[:1], self.cp_positions[g + 2, :1],
                                              cp.lm_head[g + 1].weight, projected=tables is not None, qkv0=qkv0))
            cp_logits.append(torch.stack(logits, dim=1))
        return talker_logits, torch.cat(cp_logits)


def _row_values(prompts: list[Prompt], params: list[SamplingParams], counts: list[int]) -> list[torch.Tensor]:
    """`ModelRunner._arm_rows`' host values, a tensor per dtype (int64 [7, n]: steps, max_new_tokens, seeds, trailing
    lengths, the two top-ks and each row's last prefill token; float32 [5, n]: the penalty, the two temperatures and
    top-ps; bool [4, n]: done, emitted, the two do_samples; int32 [1, n]: positions) and the trailing text [n, T]."""
    n, text = len(prompts), max(len(p.trailing_ids) for p in prompts)
    trailing = torch.zeros(n, text, dtype=torch.int32)
    for i, p in enumerate(prompts):
        if p.trailing_ids:
            trailing[i, :len(p.trailing_ids)] = torch.tensor(p.trailing_ids, dtype=torch.int32)
    top_k = ([min(getattr(q, name), TOP_K_ALL) for q in params] for name in ("top_k", "subtalker_top_k"))
    int64 = [[0] * n, [q.max_new_tokens for q in params], [q.seed for q in params],
             [len(p.trailing_ids) for p in prompts], *top_k, [k - 1 for k in itertools.accumulate(counts)]]
    float32 = [[getattr(q, name) for q in params] for name in ("repetition_penalty", "temperature", "top_p",
                                                                "subtalker_temperature", "subtalker_top_p")]
    flags = [[False] * n, [False] * n, *([bool(getattr(q, name)) for q in params]
                                         for name in ("do_sample", "subtalker_dosample"))]
    return [torch.tensor(int64), torch.tensor(float32, dtype=torch.float32), torch.tensor(flags),
            torch.tensor([[p.num_positions for p in prompts]], dtype=torch.int32), trailing]


def _copy_into(old: RowState, new: RowState) -> RowState:
    """Resets `old` in place to `new`'s values (graphs keep pointing at `old`'s tensors)."""
    for target, value in zip(old.tensors(), new.tensors()):
        target.copy_(value)
    return old


def frame_sum(embeds: torch.Tensor) -> torch.Tensor:
    """The frame embedding F(c) = Ec(c0) + sum_j Ecp[j](c_j+1) from the codes' rows embeds [16, ..., H]: added in
    that order in fp32 (as the reference loop). On CUDA, cumsum over the first axis scans in order in fp32: 2
    kernels where adding one by one takes 30; the CPU's cumsum accumulates in double, so there they are added one
    by one."""
    if embeds.is_cuda:
        return embeds.float().cumsum(0)[-1]
    frame = embeds[0].float()
    for e in embeds[1:]:
        frame = frame + e.float()
    return frame


def _probe_fp32_head(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build can produce fp32 logits straight from bf16/fp16 matrix products (cuBLAS)."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False

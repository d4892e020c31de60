"""The model runner's rows and their KV blocks (`KVRows`, a part of `ModelRunner`): the talker's paged KV cache,
a row's blocks grown as it runs (`grow`), rows freed, moved to keep the running rows 0..B-1 (`remove_rows`), and
swapped out to host memory and back into any free row unchanged (`swap_out`, `swap_in`: how the engine preempts a
row when the cache is full). The blocks' bookkeeping is the host's (`q3tts.engine.kv_blocks.KVBlocks`); here its
decisions meet the device's tensors."""

from __future__ import annotations

import torch

from ...transfer import RowViews, host_tensor, row_slice, set_row, to_device, zero_rows
from ..kv_blocks import KVBlocks
from .row_state import SwappedRow
from .transformer import PagedCache


class KVRows:
    """Row bookkeeping on the device; mixed into `ModelRunner`, which holds `model`, `config`, `device`, `dtype`,
    `max_context` and `state` (row_state.RowState)."""

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

    def grow(self, row: int, num_positions: int) -> None:
        """Makes `row` hold KV for at least `num_positions` positions (OutOfBlocks if too few blocks are free)."""
        self.grow_rows([row], [num_positions])

    def grow_rows(self, rows: list[int], num_positions: list[int]) -> None:
        """`grow` for each row, with one write of the block table; on OutOfBlocks the rows before the one that
        failed keep their new blocks."""
        cells: tuple[list[int], list[int], list[int]] = ([], [], [])  # row, index in its table, block
        try:
            self.kv.grow_rows(rows, num_positions, cells)
        finally:
            if cells[0]:
                where = to_device(host_tensor(cells, torch.int32), self.device)
                self.cache.block_table[where[0], where[1]] = where[2]

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

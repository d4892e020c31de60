"""Bookkeeping of the paged KV cache: which blocks each row holds, and which are free. Pure Python (no torch):
the model runner mirrors every change into the device block table, the scheduler asks it what fits.

Rows grow on demand, one block at a time as their positions cross a block boundary, so a row holds what it
uses, not what it might use (`max_new_tokens`). Block 0 is never handed out: rows that hold no request, and
the padding tokens of a bucketed prefill, point at it and write there harmlessly.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """No free block is left; the engine preempts a row and retries."""


class KVBlocks:
    def __init__(self, num_blocks: int, block_size: int, num_rows: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # popped from the end: low ids first
        self.rows: list[list[int]] = [[] for _ in range(num_rows)]

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def capacity_positions(self) -> int:
        """Positions all usable blocks hold together: the most one row can ever reach."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def missing(self, row: int, num_positions: int) -> int:
        """Blocks `row` still needs to hold `num_positions` positions."""
        return max(self.blocks_for(num_positions) - len(self.rows[row]), 0)

    def grow(self, row: int, num_positions: int) -> tuple[int, list[int]]:
        """Gives `row` the blocks it lacks for `num_positions` positions. Returns (index of the first new block in
        the row's table, the new block ids); raises OutOfBlocks (and changes nothing) if too few are free."""
        need = self.missing(row, num_positions)
        if need > len(self.free):
            raise OutOfBlocks(f"{need} blocks needed, {len(self.free)} free")
        start = len(self.rows[row])
        new = [self.free.pop() for _ in range(need)]
        self.rows[row].extend(new)
        return start, new

    def grow_rows(self, rows: list[int], num_positions: list[int], cells: tuple[list[int], list[int], list[int]]
                  ) -> None:
        """`grow` for each row in order, each new block appended to `cells` as (row, index in its table, block):
        the block table's writes. On OutOfBlocks the rows before keep their new blocks (in `cells`), the failing
        one and those after are unchanged. (One loop with no call per row: ~16 rows cross a block a boundary at
        256 rows.)"""
        bs, free, tables = self.block_size, self.free, self.rows
        for row, n in zip(rows, num_positions):
            held = tables[row]
            start = len(held)
            need = -(-n // bs) - start
            if need <= 0:
                continue
            if need > len(free):
                raise OutOfBlocks(f"{need} blocks needed, {len(free)} free")
            new = free[:-need - 1:-1]  # (what `need` pops from the end take: the last first)
            del free[-need:]
            held.extend(new)
            cells[0].extend([row] * need)
            cells[1].extend(range(start, start + need))
            cells[2].extend(new)

    def release(self, row: int) -> list[int]:
        """Frees the row's blocks; returns them (their contents stay until reused)."""
        blocks, self.rows[row] = self.rows[row], []
        self.free.extend(reversed(blocks))
        return blocks

    def detach(self, row: int) -> list[int]:
        """Takes the row's blocks off it, still held (a parked live row keeps them: engine/live.py)."""
        blocks, self.rows[row] = self.rows[row], []
        return blocks

    def attach(self, row: int, blocks: list[int]) -> None:
        """Gives the empty `row` blocks taken off a row by `detach`."""
        assert not self.rows[row], f"row {row} still holds blocks"
        self.rows[row] = blocks

    def release_blocks(self, blocks: list[int]) -> None:
        """Frees blocks taken off a row by `detach`."""
        self.free.extend(reversed(blocks))

    def move(self, src: int, dst: int) -> None:
        """The sequence in row `src` now lives in the empty row `dst`."""
        assert not self.rows[dst], f"row {dst} still holds blocks"
        self.rows[dst], self.rows[src] = self.rows[src], []

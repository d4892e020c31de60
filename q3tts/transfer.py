"""Small host-to-device copies that do not wait for the device, and per-row state writes in few launches.

`torch.tensor(values, device="cuda")`, `cuda_tensor[...] = cpu_tensor` and `cuda_tensor[index] = python_scalar`
copy from pageable memory, which blocks the host until the device reaches the copy: with a frame in flight, the
rest of the frame (docs/perf-notes.md, entry 46). Staging through pinned memory and copying without blocking
keeps the copy in stream order instead (the caching host allocator keeps the pinned block until the copy is
done). The engine moves, clears and arms rows of many per-row tensors between frames; `set_row`, `copy_row`,
`zero_rows` and `write_rows` do that as multi-tensor launches (one per dtype: the fused kernels take one dtype)
rather than one small launch per tensor and row, `set_rows` gives many rows one row's values, `RowViews` moves
and clears many rows at once with their views made once, and `to_device_together` stages many host tensors in
one transfer. Host tensors are built from Python lists through numpy (`host_tensor`).
"""

from __future__ import annotations

import numpy as np
import torch

PINNED = True  # False: plain synchronizing copies (bench/prefill_stall.py compares the two)


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` for (nested) lists of Python numbers, the same values, through numpy:
    2-3x less host time (torch.tensor inspects every item on its own: ~5 us for 3 x 3 ints, numpy ~1.6)."""
    return torch.from_numpy(np.array(values, dtype=_NUMPY[dtype]))


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list, number or CPU tensor on `device`, in stream order, without synchronizing on CUDA."""
    if isinstance(values, torch.Tensor):
        t = values
    else:
        t = host_tensor(values, dtype) if dtype in _NUMPY else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or not PINNED:
        return t.to(device)
    # (contiguous first: a strided host tensor would be copied through pageable memory, which synchronizes)
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def to_device_together(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors on `device` in one transfer (each `to_device` stages and copies on its own: a pinned block and
    a copy launch each): their bytes packed (`pack_bytes`), unpacked there as views. Already there (the CPU, or
    tensors on the device), they are returned as they are."""
    if torch.device(device).type != "cuda" or not PINNED or any(t.device.type != "cpu" for t in tensors):
        return [t.to(device) for t in tensors]
    flat, layout = pack_bytes(tensors)
    return unpack_bytes(to_device(flat, device), layout)


def pack_bytes(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """The tensors' bytes in one uint8 tensor, widest dtype first (so that each part stays aligned for its dtype),
    and where each is (`unpack_bytes`)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    layout, offset = [None] * len(tensors), 0
    for i in order:
        t = tensors[i]
        layout[i] = (t.dtype, t.shape, offset, t.numel() * t.element_size())
        offset += layout[i][3]
    return torch.cat([tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in order]), layout


def unpack_bytes(flat: torch.Tensor, layout: list[tuple]) -> list[torch.Tensor]:
    return [flat[offset:offset + size].view(dtype).view(shape) for dtype, shape, offset, size in layout]


def row_slice(rows: list[int]) -> slice | None:
    """rows as a slice when they follow each other (one view per tensor instead of one per row), else None."""
    return slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None


def foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """target.copy_(source) for each pair, in one multi-tensor launch per dtype: `torch._foreach_copy_` fuses only
    lists of a single dtype, and copies a mixed list one tensor at a time (a memcpy and ~6 us of host time each;
    torch's own rules may still copy some dtypes, e.g. bool, one by one)."""
    for group in _by_dtype(targets, sources):
        torch._foreach_copy_(*group)


def _by_dtype(*lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """The lists' items (pairs, for two lists) grouped by their dtypes, in order."""
    if len(lists) == 1:  # (the frame boundary's zeroing: no tuple per item)
        single: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in lists[0]:
            single.setdefault(t.dtype, []).append(t)
        return [(group,) for group in single.values()]
    groups: dict[tuple, tuple[list[torch.Tensor], ...]] = {}
    for items in zip(*lists):
        group = groups.setdefault(tuple(t.dtype for t in items), tuple([] for _ in lists))
        for members, t in zip(group, items):
            members.append(t)
    return list(groups.values())


def set_row(tensors: list[torch.Tensor], row: int, values: list[torch.Tensor]) -> None:
    """t[row] = value for every tensor (rows of per-row state) and its value, in one multi-tensor launch per
    dtype rather than one each."""
    foreach_copy([t[row] for t in tensors], values)


def set_rows(tensors: list[torch.Tensor], rows: list[int], values: list[torch.Tensor]) -> None:
    """t[rows] = value for every tensor and its value (one row's, the same for each of `rows`): one broadcast
    copy per tensor, however many rows."""
    run = row_slice(rows)
    index = run if run else to_device(rows, tensors[0].device)
    for t, value in zip(tensors, values):
        t[index] = value


def copy_row(tensors: list[torch.Tensor], src: int, dst: int) -> None:
    """t[dst] = t[src] for every tensor, in one multi-tensor launch per dtype."""
    set_row(tensors, dst, [t[src] for t in tensors])


class RowViews:
    """Rows of per-row state tensors that stay in place (a CUDA graph's), copied and cleared many at once in one
    multi-tensor launch per dtype. The rows' views are made once: indexing a tensor costs ~1 us of host time, and
    a move takes two per tensor and row (the codec's state alone is dozens of tensors)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.groups = [[t.unbind(0) for t in group] for (group,) in _by_dtype(tensors)]

    def copy(self, moves: list[tuple[int, int]]) -> None:
        """t[dst] = t[src] for every tensor and (src, dst), sources and destinations apart (a copy never reads a row
        another one writes)."""
        if moves:
            for rows in self.groups:
                torch._foreach_copy_([r[dst] for r in rows for _, dst in moves],
                                     [r[src] for r in rows for src, _ in moves])

    def zero(self, rows: list[int]) -> None:
        """t[row] = 0 for every tensor and row."""
        if rows:
            for views in self.groups:
                torch._foreach_zero_([v[row] for v in views for row in rows])


def zero_rows(tensors: list[torch.Tensor], rows: list[int]) -> None:
    """t[rows] = 0 for every tensor, in one multi-tensor launch per dtype (rows that follow each other as one
    slice)."""
    run = row_slice(rows)
    for (group,) in _by_dtype([t[run] for t in tensors] if run else [t[r] for t in tensors for r in rows]):
        torch._foreach_zero_(group)


def write_rows(targets: list[torch.Tensor], rows: list[int], values: list[torch.Tensor]) -> None:
    """target[rows] = value for each target (on the device) and its host value ([len(rows), ...]): one transfer
    per dtype, and for rows that follow each other one multi-tensor copy per dtype, instead of a transfer and a
    copy each."""
    run = row_slice(rows)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, target in enumerate(targets):
        by_dtype.setdefault(target.dtype, []).append(i)
    for dtype, group in by_dtype.items():
        host = [values[i].to(dtype).reshape(-1) for i in group]
        flat = to_device(torch.cat(host), targets[group[0]].device)
        parts = [part.view(values[i].shape) for i, part in zip(group, flat.split([v.numel() for v in host]))]
        if run:
            torch._foreach_copy_([targets[i][run] for i in group], parts)
        else:
            index = to_device(rows, flat.device)
            for i, part in zip(group, parts):
                targets[i][index] = part

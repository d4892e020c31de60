"""Small host-to-device copies that do not wait for the device.

`torch.tensor(values, device="cuda")` and `cuda_tensor[...] = cpu_tensor` copy from pageable memory, which
PyTorch follows with a stream synchronize: between frames that drains the frames in flight, and the GPU then
idles while the host finishes its bookkeeping. Staging through pinned memory and copying without blocking keeps
the copy in stream order instead (the caching host allocator keeps the pinned block until the copy is done).
"""

from __future__ import annotations

import torch

PINNED = True  # False: plain synchronizing copies (bench/prefill_stall.py compares the two)


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list, number or CPU tensor on `device`, in stream order, without synchronizing on CUDA."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None:
        t = t.to(dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or not PINNED:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

"""Whether and how the Triton kernels launch: Triton itself (absent on CPU-only installs, where every kernel's
PyTorch twin runs), the CPU interpreter switch the tests use, and programmatic dependent launch (PDL)."""

from __future__ import annotations

import functools

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the torch twins are used
    triton = None

# Test hooks. INTERPRET_ON_CPU (with TRITON_INTERPRET=1 set before triton is imported) runs the kernels on the
# CPU; USE_TWINS runs every family's PyTorch twin where its kernel would run (what the kernel is compared with).
INTERPRET_ON_CPU = False
USE_TWINS = False


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and not USE_TWINS and (t.is_cuda or INTERPRET_ON_CPU)


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 (griddepcontrol in the language, `launch_pdl` in the launcher); torch 2.4-2.6 ship older."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


# Programmatic dependent launch (Hopper and newer) for the one-row decode step's kernels (fused_linear and
# decode_attention with pdl=True): each is launched while its predecessor still runs and waits for the
# predecessor's results (griddepcontrol.wait) before reading anything it produced and before writing anything; it
# lets its own successor launch once past that wait, so the launch latency hides behind the previous kernel.
# Measured in docs/perf-notes.md (entries 42, 45): -0.08 ms per 1.7B frame at one row, a little slower at 4-64
# rows (the unfused path), and slower still when the products also prefetched their weights into L2.
PDL = triton is not None and _triton_has_pdl()


def pdl_flags(t: torch.Tensor, pdl: bool) -> dict:
    """A launch's PDL arguments (the kernel's PDL flag, and the launcher's) for a request `pdl` on `t`'s device."""
    if pdl and PDL and t.is_cuda and _capability(t.device.index)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)

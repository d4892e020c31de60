"""The SwiGLU activation (Triton), and its PyTorch twin."""

from __future__ import annotations

import torch

from .backend import triton, use_triton

if triton is not None:
    import triton.language as tl

# ---- SwiGLU activation ---------------------------------------------------------------------------------------

def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] (gate then up) -> silu(gate) * up: [N, I] in gate_up's dtype (computed in fp32)."""
    N, two_i = gate_up.shape
    inter = two_i // 2
    if not use_triton(gate_up):
        g, u = gate_up.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
    out = torch.empty(N, inter, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(inter, BLOCK))](gate_up, out, inter, BLOCK=BLOCK, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

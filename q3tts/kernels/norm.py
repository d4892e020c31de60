"""RMSNorm with a fused residual add (Triton), and its PyTorch twin."""

from __future__ import annotations

import torch

from .backend import triton, use_triton

if triton is not None:
    import triton.language as tl

# ---- RMSNorm with a fused residual add ---------------------------------------------------------------------

def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = residual + x (fp32; residual None means x starts the stream); y = rmsnorm(residual') * w.
    x: [N, D] any float dtype; returns (y [N, D] out_dtype, residual' [N, D] fp32)."""
    N, D = x.shape
    if not use_triton(x):
        r = x.float() if residual is None else residual + x.float()
        return rmsnorm_ref(r, weight, eps).to(out_dtype), r
    y = torch.empty(N, D, dtype=out_dtype, device=x.device)
    r_out = torch.empty(N, D, dtype=torch.float32, device=x.device)
    _add_rmsnorm_kernel[(N,)](x, residual if residual is not None else x, weight, y, r_out, D, eps,
                              HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(D), num_warps=4)
    return y, r_out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


if triton is not None:
    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, r_out_ptr, D, eps, HAS_RESIDUAL: tl.constexpr,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_ptr + row * D + cols, mask=mask, other=0.0)
        tl.store(r_out_ptr + row * D + cols, x, mask=mask)
        var = tl.sum(x * x, axis=0) / D
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(var + eps) * w
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

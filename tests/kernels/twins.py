"""What the kernel tests share: the device and dtypes they run in, a call of a kernel's PyTorch twin, and the
comparisons with it.

On the CPU the kernels run in Triton's interpreter (fp32; the interpreter mishandles bf16), on the GPU
(Q3TTS_GPU_TESTS=1) natively in bf16 and fp32. Inputs are fresh random data, outputs are poisoned first.
"""

from __future__ import annotations

import torch

from q3tts.kernels import backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] if DEVICE == "cpu" else [torch.float32, torch.bfloat16]


def twin(monkeypatch, fn, *args, **kwargs):
    """Runs `fn` with the Triton path switched off (the PyTorch twin)."""
    with monkeypatch.context() as m:
        m.setattr(backend, "USE_TWINS", True)
        return fn(*args, **kwargs)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
    assert err < tol, err


def close_chained(a: torch.Tensor, b: torch.Tensor, layers: int) -> None:
    """bf16 caches at the end of a chain of layers computed in two orders (fp32 sums rounded in other places): within
    1% over the whole tensor (a wrong row or head is several times that), and at the largest element within 1% after
    a code predictor's 5 layers, 3% after a talker's 28 (where one element's roundings compound)."""
    diff = a.float() - b.float()
    assert float(diff.norm() / b.float().norm()) < 1e-2
    assert float(diff.abs().max() / b.float().abs().max()) < (1e-2 if layers <= 5 else 3e-2)


def history_tokens(history: list[int]) -> tuple[torch.Tensor, ...]:
    """Rows with history[r] earlier positions each: (rows, positions) of every earlier token, then (rows,
    positions) of each row's next one, on DEVICE."""
    as_ints = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)
    return (as_ints([r for r, n in enumerate(history) for _ in range(n)]),
            as_ints([i for n in history for i in range(n)]), as_ints(list(range(len(history)))), as_ints(history))

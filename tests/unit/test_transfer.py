"""Host-to-device staging and the per-row state writes between frames (q3tts/transfer.py), and what the model
runner's bookkeeping between frames may not do: write a host scalar through an index (on a GPU that copies the
scalar from pageable memory, which waits for the frame in flight; docs/perf-notes.md entry 46)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from q3tts import TTS
from q3tts.benchmarks.common import clone_prompt
from q3tts.engine import EngineConfig
from q3tts.engine.runner.model_runner import ModelRunner
from q3tts.sampling import SamplingParams
from q3tts.tiny import tiny_checkpoint
from q3tts.transfer import copy_row, host_tensor, row_slice, set_rows, to_device, write_rows, zero_rows


def test_to_device_keeps_a_strided_tensor_s_values():
    t = torch.arange(12).reshape(3, 4).T  # (strided: staged contiguously)
    assert torch.equal(to_device(t, "cpu"), t)



def test_host_tensor_is_torch_tensor():
    """Built through numpy, the same dtype, shape and values as torch.tensor (floats rounded alike to float32)."""
    import random

    rng = random.Random(0)
    cases = [([[rng.randrange(-2**31, 2**31) for _ in range(5)] for _ in range(3)], torch.int32),
             ([rng.randrange(-2**62, 2**62) for _ in range(9)], torch.int64),
             ([[rng.uniform(-1e6, 1e6) for _ in range(4)], [0.1, 1 / 3, 0.7, 1e-40]], torch.float32),
             ([True, False, 1, 0, 3], torch.bool), ([[], []], torch.int32), (7, torch.int64)]
    for values, dtype in cases:
        a, b = host_tensor(values, dtype), torch.tensor(values, dtype=dtype)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

def test_row_slice():
    assert row_slice([3, 4, 5]) == slice(3, 6)
    assert row_slice([2]) == slice(2, 3)
    assert row_slice([1, 3]) is None and row_slice([4, 3]) is None


@pytest.mark.parametrize("rows", [[1, 2, 3], [3, 0]])
def test_row_writes(rows):
    torch.manual_seed(0)
    tensors = [torch.randn(5, 3), torch.randint(0, 9, (5,)), torch.rand(5, 2, 2) > 0.5, torch.randn(5).double()]
    values = [torch.randn(len(rows), 3), torch.tensor([7, 8, 9][:len(rows)]), torch.ones(len(rows), 2, 2),
              torch.zeros(len(rows))]
    want = [t.clone() for t in tensors]
    for w, v in zip(want, values):
        w[rows] = v.to(w.dtype)
    write_rows(tensors, rows, values)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))

    for w in want:
        w[rows] = 0
    zero_rows(tensors, rows)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))

    for w in want:
        w[0] = w[4]
    with _ForeachCalls() as calls:
        copy_row(tensors, 4, 0)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))
    assert len(calls.dtypes) == 4 and all(len(d) == 1 for d in calls.dtypes)  # one call per dtype, one dtype each

    one = [torch.randn(3), torch.tensor(5), torch.ones(2, 2, dtype=torch.bool), torch.tensor(2.5).double()]
    for w, v in zip(want, one):
        w[rows] = v
    set_rows(tensors, rows, one)  # (one row's value for every row)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))


class _ForeachCalls(TorchDispatchMode):
    """The dtypes of each multi-tensor (`_foreach_*`) call: its fused CUDA kernel takes lists of one dtype only,
    and copies a mixed list one tensor at a time."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("_foreach"):
            self.dtypes.append({t.dtype for arg in args if isinstance(arg, (list, tuple)) for t in arg})
        return func(*args, **(kwargs or {}))


class _ScalarIndexWrites(TorchDispatchMode):
    """Records index_put_ calls whose value is a 0-dim tensor (what `t[index] = python_scalar` becomes)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith("index_put") and args[2].dim() == 0:
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


def test_bookkeeping_between_frames_writes_no_host_scalar_through_an_index(tmp_path):
    tts = TTS.from_pretrained(tiny_checkpoint("tiny-base", tmp_path), device="cpu")
    runner = ModelRunner(tts.model, EngineConfig(max_rows=4, max_context=256, block_size=16, max_trailing=64))
    prompt = clone_prompt(tts.model)
    writes = _ScalarIndexWrites()
    with writes:
        runner.add_rows([0, 1, 3], [prompt] * 3, [SamplingParams(max_new_tokens=8, seed=i) for i in range(3)])
        runner.grow_rows([0, 1], [prompt.num_positions + 40, prompt.num_positions + 40])
        runner.move_row(3, 2)
        runner.release_rows([0, 2])
        runner.release_rows([1])
    assert writes.calls == []

"""Every Triton kernel of the GPU path against its PyTorch twin, one file per kernel family (so that
`--dist loadfile` spreads them over the workers); what they share is tests/kernels/twins.py."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from q3tts.kernels import backend
from tests.kernels.twins import DEVICE


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE == "cpu":  # tests/conftest.py set TRITON_INTERPRET=1 before triton was imported
        monkeypatch.setattr(backend, "INTERPRET_ON_CPU", True)
        if backend.triton is not None:
            from triton.runtime import interpreter
            monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", tree_reduce)
            monkeypatch.setattr(interpreter, "_patch_lang", PatchLangOnce(interpreter))


class PatchLangOnce:
    """Triton's interpreter's `_patch_lang` (which points triton.language's functions at the interpreter's while a
    kernel runs) without its repeats: the interpreter calls it again at every call of a @triton.jit function inside
    a kernel, and each time walks the language's modules (`inspect.getmembers`), ~30% of a fused frame's time in
    tests/kernels/test_runner_kernels.py. Inside a kernel whose call patched the same modules, nothing is left to
    patch (a repeat finds the same functions patched; the kernel's own restore undoes them all); the first call of one
    that sees other modules (triton.language.core, from its standard library's functions) goes to the original."""

    def __init__(self, interpreter):
        self.interpreter, self.original = interpreter, interpreter._patch_lang
        self.langs: dict[object, frozenset[int]] = {}  # function -> the language modules it sees
        self.active: frozenset[int] | None = None  # while a kernel runs: the modules its call patched

    def __call__(self, fn):
        tl = self.interpreter.tl
        if (langs := self.langs.get(fn)) is None:
            langs = self.langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                               if inspect.ismodule(v) and v in (tl, tl.core))
        if self.active is not None and langs <= self.active:
            return self.interpreter._LangPatchScope()
        scope = self.original(fn)
        if self.active is not None:  # (a call inside: the interpreter never restores its changes)
            self.active |= langs
        else:  # (a kernel's call: its scope is restored when the kernel ends)
            self.active, restore = langs, scope.restore

            def restore_and_end():
                self.active = None
                restore()
            scope.restore = restore_and_end
        return scope


def tree_reduce(self, input):
    """Triton's interpreter's `tl.reduce` with a combine function (`ReduceOps.generic_reduce`), as a tree of combines
    of whole halves: ~log2(n) calls of the combine function on vectors where the interpreter makes one on scalars
    for every element (the sampler's top-p search spent ~90% of its tests' time there: ~70 s of a 75 s test). A
    reduction's order is not Triton's to promise: a GPU combines each thread's elements, then across threads; this
    combines pairs of halves (so sums round pairwise, not left to right as the interpreter's)."""
    original_axis = self.axis
    input, axis = self.unravel(input, self.axis)
    dtypes = [arg.dtype for arg in input]
    data = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
    input_shape = input[0].handle.data.shape
    while data[0].shape[0] > 1:
        half = data[0].shape[0] // 2
        pair = [self.to_tensor(d[i * half:(i + 1) * half], t) for i in (0, 1) for d, t in zip(data, dtypes)]
        out = self.combine_fn.fn(*pair)
        out = out if isinstance(out, tuple) else (out,)
        data = [np.concatenate([np.broadcast_to(o.handle.data, d[:half].shape).astype(d.dtype), d[2 * half:]])
                for o, d in zip(out, data)]
    ret = []
    for d, t in zip(data, dtypes):
        d = d[0]
        if self.keep_dims:
            if original_axis is not None:
                d = np.expand_dims(d, axis)
            else:
                for _ in range(len(input_shape)):
                    d = np.expand_dims(d, 0)
        elif original_axis is None:
            d = d.item()
        ret.append(self.to_tensor(d, t))
    return ret

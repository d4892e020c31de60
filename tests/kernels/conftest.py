"""Every Triton kernel of the GPU path against its PyTorch twin, one file per kernel family (so that
`--dist loadfile` spreads them over the workers); what they share is tests/kernels/twins.py."""

from __future__ import annotations

import pytest

from q3tts.kernels import backend
from tests.kernels.twins import DEVICE


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    if DEVICE == "cpu":  # tests/conftest.py set TRITON_INTERPRET=1 before triton was imported
        monkeypatch.setattr(backend, "INTERPRET_ON_CPU", True)

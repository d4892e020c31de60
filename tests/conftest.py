from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.time_guard import pytest_runtest_makereport  # noqa: F401  (the guard on one test's time: tests/SLOW.md)

if not torch.cuda.is_available():
    # Triton kernels can then run in its interpreter (tests opt in per kernel); must precede importing triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist (scripts/test.sh runs `-n 2`) each worker's torch ops, and the processes it starts (the
    servers, the oracle), use its share of the cores: two workers of two threads each on two cores would spend
    their time waiting on each other. The oracle decodes at the same count as we do (OMP_NUM_THREADS below), so
    the equivalence tests' bit-identical audio is still checked."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores()
REPO = Path(__file__).resolve().parent.parent
ORACLE_DIR = Path(__file__).resolve().parent / "oracle"


def _oracle_python() -> Path | None:
    explicit = os.environ.get("Q3TTS_ORACLE_PYTHON")
    candidates = [Path(explicit)] if explicit else [REPO / ".venv-oracle" / "bin" / "python"]
    return next((p for p in candidates if p.exists()), None)


class Oracle:
    """Runs scripts from tests/oracle/ with the official `qwen-tts` package in its own virtual environment."""

    def __init__(self, python: Path):
        self.python = python

    def run(self, script: str, *args: str | os.PathLike, timeout: float = 900) -> str:
        cmd = [str(self.python), str(ORACLE_DIR / script), *map(str, args)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"oracle script {script} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc.stdout


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    python = _oracle_python()
    if python is None:
        message = ("the official implementation is not installed: run `.ci/run` once, or set Q3TTS_ORACLE_PYTHON "
                   "to the python of a virtual environment holding qwen-tts==0.1.1")
        if os.environ.get("Q3TTS_REQUIRE_ORACLE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return Oracle(python)


def pytest_terminal_summary(terminalreporter):
    from tests.equivalence import test_equivalence

    if test_equivalence.LARGEST:
        terminalreporter.section("largest differences against the official implementation")
        for name, value in sorted(test_equivalence.LARGEST.items()):
            terminalreporter.write_line(f"{name}: {value:.3g}")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("Q3TTS_GPU_TESTS") == "1":
        return
    skip_gpu = pytest.mark.skip(reason="GPU test: set Q3TTS_GPU_TESTS=1 on a machine with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


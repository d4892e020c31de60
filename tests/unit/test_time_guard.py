"""The guard on one test's time (tests/time_guard.py): a real pytest run on tests of its own, with a limit of a
fraction of a second, fails exactly the tests over it that are not both marked slow with a reason and listed; and
every test in tests/SLOW.md exists and is marked so."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.time_guard import SLOW_LIST, listed_slow

REPO = Path(__file__).resolve().parents[2]
LIMIT_S, OVER_S = 0.3, 0.6
TIMED = f'''
import time

import pytest


def test_quick():
    pass


def test_over():
    time.sleep({OVER_S})


@pytest.mark.slow(reason="measured")
def test_marked_not_listed():
    time.sleep({OVER_S})


def test_listed_not_marked():
    time.sleep({OVER_S})


@pytest.mark.slow
def test_listed_marked_without_a_reason():
    time.sleep({OVER_S})


@pytest.mark.slow(reason="measured")
def test_marked_and_listed():
    time.sleep({OVER_S})


@pytest.mark.slow(reason="measured")
@pytest.mark.parametrize("n", [1, 2])
def test_marked_and_listed_with_parameters(n):
    time.sleep({OVER_S})


def test_over_and_failing():
    time.sleep({OVER_S})
    assert False, "its own failure"
'''
LISTED = ["test_listed_not_marked", "test_listed_marked_without_a_reason", "test_marked_and_listed",
          "test_marked_and_listed_with_parameters"]


def test_the_guard_fails_slow_tests_unless_marked_and_listed(tmp_path):
    (tmp_path / "test_timed.py").write_text(TIMED)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow(reason): over the limit\n")
    (tmp_path / "SLOW.md").write_text("".join(f"- `test_timed.py::{name}`: measured\n" for name in LISTED))
    env = {**os.environ, "PYTHONPATH": str(REPO), "Q3TTS_TEST_TIME_LIMIT": str(LIMIT_S),
           "Q3TTS_SLOW_LIST": str(tmp_path / "SLOW.md")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.time_guard", "-p", "no:cacheprovider", "-rA",
                          "-q", "test_timed.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    outcomes = {line.split()[1]: line.split()[0] for line in run.stdout.splitlines()
                if line.startswith(("PASSED ", "FAILED "))}
    assert outcomes == {
        "test_timed.py::test_quick": "PASSED", "test_timed.py::test_over": "FAILED",
        "test_timed.py::test_marked_not_listed": "FAILED", "test_timed.py::test_listed_not_marked": "FAILED",
        "test_timed.py::test_listed_marked_without_a_reason": "FAILED",
        "test_timed.py::test_marked_and_listed": "PASSED",
        "test_timed.py::test_marked_and_listed_with_parameters[1]": "PASSED",
        "test_timed.py::test_marked_and_listed_with_parameters[2]": "PASSED",
        "test_timed.py::test_over_and_failing": "FAILED"}, run.stdout[-3000:]
    assert run.returncode == 1
    assert f"over the {LIMIT_S:g} s limit on one test (tests/SLOW.md)" in run.stdout
    assert "its own failure" in run.stdout  # (a test that fails on its own keeps its own report)


def _marked_slow_with_a_reason(function: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.slow"
               and any(k.arg == "reason" for k in d.keywords) for d in function.decorator_list)


def test_every_listed_test_exists_and_is_marked_slow_with_a_reason():
    listed = listed_slow(str(SLOW_LIST))
    assert listed, "tests/SLOW.md lists no test: the guard reads its backquoted node ids"
    for node_id in sorted(listed):
        path, name = node_id.split("::")
        tree = ast.parse((REPO / path).read_text())
        functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        assert name in functions, f"tests/SLOW.md lists {node_id}, which does not exist"
        assert _marked_slow_with_a_reason(functions[name]), f"{node_id} is listed but not marked slow with a reason"

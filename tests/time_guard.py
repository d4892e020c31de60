"""The guard on one test's time: a test whose call takes over the limit fails, unless it is marked
`@pytest.mark.slow(reason=...)` and listed in tests/SLOW.md.

Why: the whole suite must stay within CI's time on the 2-core machine, and every issue adds tests; a test that
grows past the limit unnoticed is the one that makes the next run miss it. The limit is the test's call alone
(module fixtures excluded: they are paid once), `Q3TTS_TEST_TIME_LIMIT` seconds: scripts/test.sh (CI) sets 90; unset,
the guard is off (a test's wall time on a busy shared machine says nothing). tests/conftest.py loads it;
tests/unit/test_time_guard.py runs it on tests of its own (`Q3TTS_SLOW_LIST` names their list).
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import pytest

SLOW_LIST = Path(__file__).resolve().parent / "SLOW.md"
_LISTED = re.compile(r"`([^`\s]+::[^`\s\[]+)`")


def time_limit_s() -> float | None:
    """The limit on one test's call, in seconds (None: no limit)."""
    limit = os.environ.get("Q3TTS_TEST_TIME_LIMIT", "")
    return float(limit) if limit else None


@cache
def listed_slow(path: str) -> frozenset[str]:
    """The node ids (without parameters) that the list at `path` names in backquotes."""
    return frozenset(_LISTED.findall(Path(path).read_text()))


def allowed_slow(item: pytest.Item) -> bool:
    """Whether `item` is marked slow with a reason and its test is listed."""
    marker = item.get_closest_marker("slow")
    listed = listed_slow(os.environ.get("Q3TTS_SLOW_LIST", str(SLOW_LIST)))
    return bool(marker and marker.kwargs.get("reason")) and item.nodeid.split("[")[0] in listed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    limit = time_limit_s()
    if limit is None or call.when != "call" or not report.passed or call.duration <= limit or allowed_slow(item):
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} took {call.duration:.1f} s, over the {limit:g} s limit on one test "
                       "(tests/SLOW.md): make it faster, or mark it @pytest.mark.slow(reason=...) and list it in "
                       "tests/SLOW.md")

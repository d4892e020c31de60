"""bench/results/README.md is the index that scripts/results_index.py writes from the result files: a result added
(or a name outside the naming scheme) without the index written again fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_results_index_is_up_to_date():
    run = subprocess.run([sys.executable, "scripts/results_index.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr

"""The docs site builds with `mkdocs build --strict` (a broken link, a missing page or an unresolved API name fails
it), and the committed plots are exactly what scripts/plots.py draws from the committed results (a result file it
cannot read fails it). Both need the docs extra (`pip install -e '.[docs]'`, part of the dev extras); without it they
skip, and fail under Q3TTS_REQUIRE_DOCS=1 (as scripts/test.sh runs them)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from .snippets import DOCS, REPO


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed: pip install -e '.[docs]'"
        if os.environ.get("Q3TTS_REQUIRE_DOCS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


def test_site_builds_strict(tmp_path):
    _require("mkdocs")
    _require("material")
    _require("mkdocstrings_handlers.python")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    site = tmp_path / "site"
    assert (site / "reference" / "api" / "index.html").read_text().count("generate_voice_clone") > 0
    assert (site / "bench" / "results" / "2026-12-02-tts-bench-h200.json").is_file()  # the figures' data


def test_plots_are_the_committed_ones(tmp_path):
    _require("matplotlib")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "plots.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    drawn = sorted(p.name for p in tmp_path.glob("*.svg"))
    committed = sorted(p.name for p in (DOCS / "img").glob("*.svg"))
    assert drawn == committed, "docs/img holds other plots than scripts/plots.py draws"
    stale = [name for name in drawn if (tmp_path / name).read_bytes() != (DOCS / "img" / name).read_bytes()]
    assert not stale, f"docs/img/{stale} differ from what scripts/plots.py draws: run it and commit the result"


def test_every_figure_names_its_data():
    """Each image in the docs is followed, before the next image or heading, by a link to the result file it came
    from."""
    missing = []
    for page in DOCS.rglob("*.md"):
        text = page.read_text()
        for match in re.finditer(r"!\[[^\]]*\]\([^)]*\)", text):
            rest = text[match.end():]
            end = min([m.start() for m in (re.search(r"!\[", rest), re.search(r"^#", rest, re.M)) if m] + [len(rest)])
            if not re.search(r"\]\([./]*bench/results/[^)]+\.json\)", rest[:end]):
                missing.append(f"{page.relative_to(REPO)}: {match.group(0)}")
    assert not missing, f"figures without a link to their result file: {missing}"


def test_readme_links_resolve():
    """The README (the repository's front page, outside the site's strict build) links only to files that exist,
    and to pages rather than run logs: no result file, no commit hash."""
    text = (REPO / "README.md").read_text()
    targets = [m.group(1).split("#")[0] for m in re.finditer(r"\]\(([^)\s]+)\)", text)]
    local = [t for t in targets if t and "://" not in t]
    assert local, "the README links to its docs"
    assert not [t for t in local if not (REPO / t).exists()], "README links to files that do not exist"
    assert not [t for t in local if t.startswith("bench/results/")], "the README links to pages, not result files"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text), "no commit hashes in the README"

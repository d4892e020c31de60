"""MkDocs hooks (mkdocs.yml `hooks:`): the repository files the docs link to (the benchmark results behind every
figure and number, the deployment manifests, the client examples) are published with the site at their repository
paths, so a link such as `bench/results/2026-12-02-tts-bench-h200.json` resolves, and `mkdocs build --strict` fails
when the file it names is gone."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = ("bench/results", "deploy", "examples")


def on_files(files: Files, config) -> Files:
    for folder in PUBLISHED:
        for path in sorted((REPO / folder).rglob("*")):
            # (not Markdown: mkdocs would make a page of it outside the nav; bench/results/README.md is the
            # repository's index of the files, for readers of the repository)
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".md":
                files.append(File.generated(config, path.relative_to(REPO).as_posix(), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The lab notebook (docs/perf-notes.md) is free prose written as runs happen: its bracketed asides
    ("[instruction] [assistant header, 3]") are not reference links, so they are kept from being read as ones."""
    if page.file.src_uri == "perf-notes.md":
        return markdown.replace("] [", "]&#32;[")
    return markdown

"""Every code block of the docs runs (python), parses (each `q3tts` command) or runs in bash (blocks marked `run`),
against the tiny models: the docs cannot drift from the code. The convention: tests/docs/snippets.py."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import io
import re
import subprocess

import pytest

from q3tts import TTS

from .snippets import (
    REPO,
    SHELL_OPERATORS,
    Block,
    adapt,
    blocks,
    commands,
    pages,
    python_blocks,
    shell_blocks,
    split,
    write_files,
)

PYTHON_PAGES = [p for p in pages() if python_blocks(p)]
SHELL_PAGES = [p for p in pages() if shell_blocks(p)]


def _ids(paths):
    return [p.relative_to(REPO).as_posix() for p in paths]


def _server(block: Block, servers) -> str | None:
    """The block's server (host:port), started only if the block talks to localhost:8000."""
    if not re.search(r"(localhost|127\.0\.0\.1):80(00|91)", block.code):
        return None
    return servers.url(block.option("server", "custom_voice"))


def _run_python(block: Block, code: str, namespace: dict) -> None:
    compiled = compile(code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)  # noqa: S307 (the docs' own code)
    if inspect.iscoroutine(result):  # a block with a top-level `await`
        asyncio.run(result)


def _close_models(namespace: dict) -> None:
    for value in namespace.values():
        if isinstance(value, TTS):
            value.close()


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_ids(PYTHON_PAGES))
def test_python_blocks_run(page, hub, scratch, servers):
    page_blocks = python_blocks(page)
    write_files(page, scratch)
    namespace: dict = {}
    skipped = []
    try:
        for block in page_blocks:
            if block.skipped:
                skipped.append(f"{block.where}: {block.skipped}")
                continue
            if block.has("fresh") or not namespace:
                _close_models(namespace)
                namespace = {"__name__": "__main__", "play": lambda pcm, *args: None}
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    _run_python(block, adapt(block.code, _server(block, servers)), namespace)
                except Exception as e:
                    raise AssertionError(f"{block.where} failed: {type(e).__name__}: {e}") from e
    finally:
        _close_models(namespace)
    if skipped and len(skipped) == len(page_blocks):
        pytest.skip("; ".join(skipped))


@pytest.mark.parametrize("page", SHELL_PAGES, ids=_ids(SHELL_PAGES))
def test_shell_commands_parse(page):
    """Each `q3tts` command the page shows is one q3tts's parser takes, flag for flag."""
    from q3tts.cli.commands import build_parser

    checked = 0
    for block in shell_blocks(page):
        if block.pending:
            continue
        for argv in commands(block.code):
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                try:
                    build_parser().parse_args(argv)
                except SystemExit as e:
                    assert e.code == 0, f"{block.where}: `q3tts {' '.join(argv)}` does not parse: {stderr.getvalue()}"
            checked += 1
    if not checked:
        pytest.skip("no q3tts command on this page")


RUN_PAGES = [p for p in SHELL_PAGES if any(b.has("run") for b in shell_blocks(p))]


def _plain(code: str) -> bool:
    """Whether a block is nothing but `q3tts` commands (no pipes, redirections, other programs): those run
    in-process, which spares each a Python start and torch's import."""
    for line in re.sub(r"\\\n", " ", code).splitlines():
        words = split(line)
        if not words and line.strip() and not line.strip().startswith("#"):
            return False
        if words and (words[0] != "q3tts" or any(w in SHELL_OPERATORS or w[:1] in "<>|" for w in words)):
            return False
    return True


def _run_in_process(block: Block, code: str) -> None:
    from q3tts.cli import main

    for argv in commands(code):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            status = main(argv)
        assert status == 0, f"{block.where}: `q3tts {' '.join(argv)}` exited {status}: {stderr.getvalue()[-3000:]}"


@pytest.mark.parametrize("page", RUN_PAGES, ids=_ids(RUN_PAGES))
def test_shell_blocks_run(page, hub, scratch, docs_env, servers):
    write_files(page, scratch)
    for block in [b for b in blocks(page) if b.lang in ("bash", "sh", "shell") and b.has("run")]:
        if block.skipped:
            continue
        code = adapt(block.code, _server(block, servers))
        if _plain(code):
            _run_in_process(block, code)
            continue
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=scratch, env=docs_env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n" \
                                     f"{proc.stderr[-4000:]}"

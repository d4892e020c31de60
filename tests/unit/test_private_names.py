"""No private name is used outside the module that defines it, in q3tts/, bench/, scripts/, examples/ or tests/: a
module's `_name`s are its own to change. An `ast` walk of the tree finds every import of a `_name` from our modules
and every read of `x._name` (x not self or cls) where `_name` is defined by another of our modules and not by the
reading one (a module defines what it assigns at its top level, in its classes' bodies and on `self`).

ALLOWED lists the uses that remain (none now), each with its reason; a use not in it fails, and so does an entry that no
longer occurs.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("q3tts", "bench", "scripts", "examples", "tests")
SKIPPED = ("tests/oracle/", "tests/clients/vendor/")  # (run with the official package's and clients' environments)
OURS = ("q3tts", "bench", "tests")

# (file, name): number of uses, each with its reason beside it. Empty: a test or benchmark that needs a module's
# internals uses the public name or the documented test hook that the module gives it.
ALLOWED: Counter = Counter()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules() -> dict[str, ast.Module]:
    paths = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    return {str(p.relative_to(REPO)): ast.parse(p.read_text()) for p in paths
            if not str(p.relative_to(REPO)).startswith(SKIPPED)}


def _statements(body: list[ast.stmt]):
    """The statements of a module's or a class's body, those inside its if/try/with/for blocks too (not those of
    its functions)."""
    for statement in body:
        yield statement
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        blocks = [getattr(statement, field, []) for field in ("body", "orelse", "finalbody")]
        blocks += [handler.body for handler in getattr(statement, "handlers", [])]
        for block in blocks:
            yield from _statements(block)


def _defined(tree: ast.Module) -> set[str]:
    """What a module defines: its top-level and class-level names, and the attributes it sets on `self`."""
    names = set()
    bodies = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for statement in (s for body in bodies for s in _statements(body)):
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        for target in ast.walk(statement) if isinstance(statement, (ast.Assign, ast.AnnAssign)) else ():
            if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                names.add(target.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            names.add(node.attr)
    return names


def private_uses(modules: dict[str, ast.Module]) -> Counter:
    """(file, name) -> uses of another module's private name."""
    defined = {path: _defined(tree) for path, tree in modules.items()}
    everywhere = set().union(*defined.values())
    uses = Counter()
    for path, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in OURS):
                uses.update((path, alias.name) for alias in node.names if _is_private(alias.name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_private(node.attr) \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and node.attr in everywhere and node.attr not in defined[path]:
                uses[(path, node.attr)] += 1
    return uses


def test_no_private_name_is_used_outside_its_module():
    uses = private_uses(_modules())
    new = {use: n for use, n in uses.items() if n > ALLOWED[use]}
    assert not new, f"private names used outside their module (use a public API or a documented test hook): {new}"
    gone = {use: n for use, n in ALLOWED.items() if uses[use] < n}
    assert not gone, f"no longer used: lower or remove their entries in ALLOWED: {gone}"


def test_the_walk_finds_imports_and_reads_of_other_modules_private_names():
    """The walk itself, on modules of its own: another module's `_name` imported or read is found; its own, a
    dunder, self's, and a private name that no module of ours defines (a library's) are not."""
    modules = {name: ast.parse(text) for name, text in {
        "q3tts/a.py": "_TABLE = {}\n\n\nclass Runner:\n    def __init__(self):\n        self._frame = 0\n\n\n"
                      "def _helper():\n    return _TABLE, Runner()._frame\n",
        "tests/b.py": "import os\n\nfrom q3tts.a import Runner, _helper\nfrom q3tts import a\n\n\n"
                      "def test():\n    return a._TABLE, Runner()._frame, a.__name__, os._exit, _helper\n",
    }.items()}
    assert private_uses(modules) == Counter({("tests/b.py", "_helper"): 1, ("tests/b.py", "_TABLE"): 1,
                                             ("tests/b.py", "_frame"): 1})

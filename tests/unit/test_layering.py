"""The package's one way through (issue 44): an `ast` walk of q3tts/ that fails on an import cycle (imports inside
functions and under TYPE_CHECKING count), on an import of a later stage than the importer's, on a fetching or
serving import below the request stage, and on a class of more than MAX_METHODS methods (private names used outside
their module: test_private_names.py). The stages are written down once, in STAGES, and drawn in
docs/architecture.md.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "q3tts"

# A module may import its own stage and earlier ones, never a later one. The longest matching prefix decides.
STAGES: dict[str, int] = {
    # 0 foundations: errors, typed configs, sampling parameters, host<->device copies, safetensors loading
    "q3tts.errors": 0, "q3tts.config": 0, "q3tts.sampling": 0, "q3tts.transfer": 0, "q3tts.checkpoint": 0,
    "q3tts.layers": 1,  # plain-PyTorch building blocks (attention, norms, rotary)
    "q3tts.kernels": 2, "q3tts.models": 2,  # Triton/Gluon kernels with PyTorch twins; the checkpoint's nn.Modules
    # 3 the engine's records, read by the device side: its config, prompts, sequences, KV block bookkeeping
    "q3tts.engine.config": 3, "q3tts.engine.prompt": 3, "q3tts.engine.sequence": 3, "q3tts.engine.kv_blocks": 3,
    "q3tts.engine.runner": 4,  # the device side: model runner, sampler state, codec, graphs, prefix cache
    "q3tts.engine": 5, "q3tts.reference": 5,  # the host side: engine loop, scheduler, rows, streams; the eager loop
    "q3tts.request": 6, "q3tts.teacher_forcing": 6, "q3tts.tiny": 6,  # a request's way in; tiny random checkpoints
    "q3tts.api": 7, "q3tts.benchmarks": 7,  # TTS, the official drop-in, streaming, long texts; in-process benchmarks
    "q3tts.server": 8, "q3tts.cli": 8, "q3tts.ray_serve": 8,  # HTTP, the command line
    "q3tts": 9,  # the package's lazy front door (`from q3tts import TTS`)
}
# Third-party modules that fetch or serve, which nothing below the request stage may import.
FETCHING_OR_SERVING = ("huggingface_hub", "urllib", "http", "socket", "requests", "httpx", "fastapi", "starlette",
                       "uvicorn", "websockets", "zmq")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()


def _imports(name: str, tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(imported module, names imported from it) for every import statement anywhere in the module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if _is_package(name) else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


@cache
def edges() -> dict[str, set[str]]:
    """Module -> the q3tts modules it imports (`from pkg import mod` counts as importing pkg.mod)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, tree in known.items():
        targets = set()
        for base, names in _imports(name, tree):
            if base.split(".")[0] != "q3tts":
                continue
            submodules = {f"{base}.{n}" for n in names} & known.keys()
            targets |= submodules or {base}
            if len(submodules) < len(names):
                targets.add(base)
        graph[name] = targets - {name}
    return graph


def stage(name: str) -> int:
    return STAGES[max((p for p in STAGES if name == p or name.startswith(p + ".")), key=len)]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycles():
    # A package's __init__ is left out as a target of its own submodules (Python loads it first anyway).
    graph = {m: {t for t in ts if t not in _ancestors(m)} for m, ts in edges().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_module_imports_a_later_stage():
    upward = [f"{m} (stage {stage(m)}) imports {t} (stage {stage(t)})" for m, ts in sorted(edges().items())
              for t in sorted(ts) if stage(t) > stage(m) and t not in _ancestors(m)]
    assert not upward, "\n".join(upward)


def test_nothing_below_the_request_fetches_or_serves():
    offending = [f"{m} imports {base}" for m, tree in sorted(modules().items()) if stage(m) < stage("q3tts.request")
                 for base, _ in _imports(m, tree) if base.split(".")[0] in FETCHING_OR_SERVING]
    assert not offending, "\n".join(offending)


def test_importing_the_scheduler_loads_no_torch():
    code = "import sys, q3tts.engine.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "False"


MAX_METHODS = 16  # a class of one concern (issue 44: ~15); nano-vllm's ModelRunner has 15
TOO_MANY_METHODS: dict[str, int] = {}  # known exceptions, each to be split: the list may only shrink


def test_classes_keep_to_one_concern():
    """No class defines more than MAX_METHODS methods (its own, public or private), but the listed ones, each at
    its listed size (which a split lowers, until the class leaves the list)."""
    counts = {f"{m}.{node.name}": sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
              for m, tree in modules().items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    over = {name: n for name, n in counts.items() if n > TOO_MANY_METHODS.get(name, MAX_METHODS)}
    grew_or_shrank = {name: counts.get(name) for name, n in TOO_MANY_METHODS.items() if counts.get(name) != n}
    assert not over, f"classes with more than {MAX_METHODS} methods (split them by concern): {over}"
    assert not grew_or_shrank, f"listed classes whose size changed (update TOO_MANY_METHODS; under {MAX_METHODS + 1} "\
        f"methods, take them off): {grew_or_shrank}"

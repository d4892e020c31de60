"""The code blocks of the docs (docs/**/*.md), found and made runnable against the tiny models.

The convention, for whoever writes a page:

* Every ```python block runs, in page order, in one namespace per page (a later block may use what an earlier
  one made), in a scratch folder holding `me.wav`, `ref.wav`, `voice.wav`, `reference.wav`, `ref_audio.wav`
  (short recordings), `chapter.txt` and `text.txt`. Write the code as a user on a GPU would: the official hub ids
  (`Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice`, ...) resolve to tiny random checkpoints of the same kind and size
  whose generation_config.json stops every request after 5 frames (a fake, offline hub cache); "cuda" / "cuda:0"
  become "cpu", `torch.bfloat16` becomes `torch.float32`, and an explicit `max_new_tokens=N` (or
  `--max-new-tokens N`) becomes 6; `localhost:8000` (and vLLM-Omni's `localhost:8091`) is a real `q3tts serve` of
  the tiny models (CustomVoice; `server=base` below: Base). The harness provides one name, `play(pcm)`, which
  discards the audio.
* A block with a title that is not code (```json title="jobs.jsonl") is a file: it is written into the scratch
  folder before the page's blocks run.
* A ```text block marked `transcript` is a WebSocket session (`→` client, `←` server), replayed against a real
  server (tests/docs/test_transcripts.py).
* Every `q3tts ...` command in a ```bash block is checked against q3tts's own argument parser (each flag must
  exist and parse); the block runs for real, with `bash -e`, only when marked `run` (cheap commands: `say`,
  `voice create`, `batch`, curl against the page's server; never `serve`, docker, kubectl, pip).
* An HTML comment right before a block changes this: `<!-- snippet: WORDS -->`, WORDS being any of
  - `skip REASON`: not run (say why: a GPU benchmark, a cluster);
  - `theirs`: another engine's code (the migration guides' "before" side): never run or parsed;
  - `pending NAME`: needs `NAME` (a dotted attribute, e.g. `q3tts.Voice.from_embedding`), which another branch
    adds: runs once it exists, skipped (with NAME as the reason) until then;
  - `run`: run a bash block;
  - `fresh`: start this python block in a new namespace;
  - `server=base`: the block's `localhost:8000` is a tiny Base server (voice uploads, cloning);
  - `transcript`: see above.
"""

from __future__ import annotations

import importlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
UNTESTED_PAGES = {"perf-notes.md"}  # the lab notebook: commands of past runs, kept as they were run
PYTHON, SHELL = ("python", "py"), ("bash", "sh", "shell", "console")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)(.*)$")
TITLE = re.compile(r'title="([^"]+)"')
OFFICIAL_IDS = {f"Qwen/Qwen3-TTS-12Hz-{size}-{kind}": (size, kind)
                for size, kind in (("0.6B", "CustomVoice"), ("1.7B", "CustomVoice"), ("1.7B", "VoiceDesign"),
                                   ("0.6B", "Base"), ("1.7B", "Base"))}
TINY_OF = {("0.6B", "CustomVoice"): "tiny-custom-voice-0.6b", ("1.7B", "CustomVoice"): "tiny",
           ("1.7B", "VoiceDesign"): "tiny-voice-design", ("0.6B", "Base"): "tiny-base",
           ("1.7B", "Base"): "tiny-base-1.7b"}
SHELL_OPERATORS = {"|", "||", "&&", ";", "<", ">", ">>", "2>", "&"}
MAX_NEW_TOKENS = 6  # what a tiny request is held to (5 frames): the tiny checkpoints' generation config, and any
# explicit max_new_tokens a snippet gives (the tiny random models never end on their own)


@dataclass
class Block:
    page: str  # relative to the repository: docs/....md, or README.md
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    words: list[str] = field(default_factory=list)  # the marker's words
    title: str | None = None  # ```json title="jobs.jsonl": a file the page's commands read

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def has(self, word: str) -> bool:
        return any(w == word or w.startswith(word + "=") for w in self.words)

    def option(self, name: str, default: str | None = None) -> str | None:
        return next((w.split("=", 1)[1] for w in self.words if w.startswith(name + "=")), default)

    @property
    def pending(self) -> str | None:
        """The attribute this block waits for, while it does not exist (None once it does, or if none)."""
        if "pending" not in self.words:
            return None
        name = self.words[self.words.index("pending") + 1]
        return None if _resolves(name) else name

    @property
    def skipped(self) -> str | None:
        """Why this block does not run (None: it runs)."""
        if "theirs" in self.words:
            return "another engine's code"
        if "skip" in self.words:
            reason = " ".join(self.words[self.words.index("skip") + 1:])
            assert reason, f"{self.where}: `snippet: skip` needs a reason"
            return reason
        if self.pending:
            return f"waits for {self.pending}"
        return None


def pages() -> list[Path]:
    """The docs' pages and the README (the front page: its examples run like the docs')."""
    docs = sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).as_posix() not in UNTESTED_PAGES)
    return [REPO / "README.md", *docs]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a page (indented ones too: admonitions, tabs), with the marker before each."""
    lines, found, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang, start = match.group(1), match.group(2).lower(), i
        title = TITLE.search(match.group(3))
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")
                   and lines[j].startswith(indent))
        code = "\n".join(line[len(indent):] for line in lines[i + 1:end])
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        found.append(Block(path.relative_to(REPO).as_posix(), start + 1, lang, code,
                           marker.group(1).split() if marker else [], title.group(1) if title else None))
        i = end + 1
    return found


def write_files(path: Path, folder: Path) -> None:
    """The page's titled blocks that are files (```json title="jobs.jsonl"), written into `folder`."""
    for block in blocks(path):
        if block.title and block.lang not in PYTHON + SHELL:
            (folder / block.title).write_text(block.code + "\n")


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in PYTHON]


def shell_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in SHELL and "theirs" not in b.words]


def adapt(code: str, server: str | None) -> str:
    """What a user would run on a GPU, made to run here (see the module docstring)."""
    code = re.sub(r"([\"'])cuda(:\d+)?\1", r"\1cpu\1", code)
    code = code.replace("torch.bfloat16", "torch.float32")
    code = re.sub(r"(max_new_tokens\s*=\s*|--max-new-tokens[ =])\d+", rf"\g<1>{MAX_NEW_TOKENS}", code)
    code = re.sub(r"--device(s)?[ =]cuda(:\d+)?(,cuda:\d+)*", "--device cpu", code)
    if server is not None:
        code = re.sub(r"(localhost|127\.0\.0\.1):80(00|91)", server, code)
    return code


def commands(code: str) -> list[list[str]]:
    """The `q3tts ...` commands of a shell block, as argv lists (continuation lines joined; comments, environment
    assignments in front and whatever follows a pipe or redirection dropped)."""
    text = re.sub(r"\\\n", " ", code)
    found = []
    for line in text.splitlines():
        words = split(line)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words[:1] != ["q3tts"]:
            continue
        cut = next((i for i, w in enumerate(words) if w in SHELL_OPERATORS), len(words))
        found.append(words[1:cut])
    return found


def split(line: str) -> list[str]:
    """A shell line's words ([] for a line that is part of a quoted string spanning lines, e.g. curl's JSON)."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return []


def _resolves(dotted: str) -> bool:
    """Whether `a.b.C.d` names something that exists (a module, then attributes)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False

"""What the docs tests share: an offline hub cache in which the official ids are tiny checkpoints, a scratch folder
of input files, and real servers of the tiny models started on first use (tests/docs/snippets.py says why)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from q3tts.tiny import tiny_checkpoint

from .snippets import MAX_NEW_TOKENS, OFFICIAL_IDS, TINY_OF

COMMIT = "0" * 40  # the fake hub's only revision
SAMPLE_RATE = 24000


def limited(name: str, folder: Path) -> Path:
    """A copy of the tiny checkpoint `name` that stops after 5 frames, greedily (the tiny models never end)."""
    shutil.copytree(tiny_checkpoint(name), folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, subtalker_dosample=False)
    path.write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="package")
def hub_cache(tmp_path_factory) -> Path:
    """A huggingface_hub cache holding each official id as a limited tiny checkpoint."""
    root = tmp_path_factory.mktemp("hub")
    for repo_id, kind in OFFICIAL_IDS.items():
        folder = root / ("models--" + repo_id.replace("/", "--"))
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(COMMIT)
        limited(TINY_OF[kind], folder / "snapshots" / COMMIT)
    return root


@pytest.fixture
def hub(hub_cache, monkeypatch) -> Path:
    """`hub_cache` made this process's hub, offline, for one test (the commands a test starts get it through
    `docs_env`)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def recording(seconds: float = 2.0, pitch_hz: float = 180) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * pitch_hz * t) * (1 + 0.5 * np.sin(2 * np.pi * 4 * t))).astype(np.float32)


@pytest.fixture(scope="package")
def inputs(tmp_path_factory) -> Path:
    """The files the snippets read: reference recordings and texts."""
    folder = tmp_path_factory.mktemp("inputs")
    for name in ("me.wav", "ref.wav", "voice.wav", "reference.wav", "ref_audio.wav"):
        sf.write(folder / name, recording(), SAMPLE_RATE, subtype="PCM_16")
    (folder / "chapter.txt").write_text("It was a bright cold day in April. The clocks were striking thirteen.\n")
    (folder / "text.txt").write_text("Hello from standard input.\n")
    return folder


@pytest.fixture
def scratch(inputs, tmp_path, monkeypatch) -> Path:
    """A fresh folder with the input files, made the current folder."""
    for path in inputs.iterdir():
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="package")
def docs_env(hub_cache, tmp_path_factory) -> dict[str, str]:
    """The environment of the shell snippets: `q3tts` on PATH (this interpreter, this tree), the fake hub."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "q3tts"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m q3tts.cli \"$@\"\n")
    shim.chmod(0o755)
    repo = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HF_HUB_CACHE": str(hub_cache),
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}


class Servers:
    """Tiny servers by kind ("custom_voice": the hub's 1.7B CustomVoice id; "base": 0.6B Base), each started on
    first use (by a test that has the `hub`) and stopped after the last docs test."""

    MODELS = {"custom_voice": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "base": "Qwen/Qwen3-TTS-12Hz-0.6B-Base"}

    def __init__(self, default_voice: Path):
        self.running, self.default_voice = {}, default_voice

    def url(self, kind: str) -> str:
        from q3tts.server import ServerConfig
        from tests.server.harness import ServerThread

        if kind not in self.running:
            config = ServerConfig(model=self.MODELS[kind], device="cpu", max_running=4, warmup=False,
                                  default_voice=str(self.default_voice) if kind == "base" else None)
            self.running[kind] = ServerThread(config).__enter__()
        return self.running[kind].url.removeprefix("http://")

    def close(self) -> None:
        for server in self.running.values():
            server.__exit__(None, None, None)


@pytest.fixture(scope="package")
def servers(hub_cache, inputs):
    running = Servers(inputs / "voice.wav")
    yield running
    running.close()

"""Servers shared by every client test: one `q3tts serve` of each tiny model kind, CustomVoice, Base (with a default
voice, a recording given at start-up) and VoiceDesign, each started when first needed and stopped after the last
client test (see harness.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from tests.clients.harness import ServeProcess, limited_checkpoint, voice_sample  # noqa: E402

SERVED_MODEL_NAME = "tiny"


@pytest.fixture(scope="package")
def custom_voice_server(tmp_path_factory) -> ServeProcess:
    root = tmp_path_factory.mktemp("custom-voice")
    with ServeProcess(limited_checkpoint("tiny", root / "tiny-clients"), SERVED_MODEL_NAME, root / "serve.log") as s:
        yield s


@pytest.fixture(scope="package")
def base_server(tmp_path_factory) -> ServeProcess:
    root = tmp_path_factory.mktemp("base")
    folder = limited_checkpoint("tiny-base", root / "tiny-base-clients")
    (root / "default-voice.wav").write_bytes(voice_sample())
    with ServeProcess(folder, SERVED_MODEL_NAME, root / "serve.log", "--voices-dir", str(root / "voices"),
                      "--default-voice", str(root / "default-voice.wav")) as s:
        yield s


@pytest.fixture(scope="package")
def voice_design_server(tmp_path_factory) -> ServeProcess:
    root = tmp_path_factory.mktemp("voice-design")
    folder = limited_checkpoint("tiny-voice-design", root / "tiny-voice-design-clients")
    with ServeProcess(folder, SERVED_MODEL_NAME, root / "serve.log") as s:
        yield s

"""Home Assistant's path to an OpenAI-compatible server: the real `wyoming_openai` 0.8.0 bridge process in front of
`q3tts serve` (tiny CustomVoice model), spoken to over the Wyoming protocol with the `wyoming` package as Home
Assistant does (examples/home_assistant/wyoming_tts.py, run with the bridge environment's Python).

The bridge runs as its README's minimal configuration has it: no voices configured, so it offers OpenAI's voice
names (it finds no Kokoro, Speaches or LocalAI behind the URL), for a non-streaming model (tts-1) and a streaming
one (gpt-4o-mini-tts). It asks the server for WAV and hands the PCM on in Wyoming audio chunks."""

from __future__ import annotations

import json

import pytest

from tests.clients.harness import (
    EXAMPLES,
    SECONDS,
    TEXT,
    Background,
    assert_complete_audio,
    client_python,
    free_port,
    run_client,
)

SPEAK = EXAMPLES / "home_assistant" / "wyoming_tts.py"

PYTHON = client_python("wyoming")


@pytest.fixture(scope="module")
def bridge(custom_voice_server, tmp_path_factory):
    """The bridge's Wyoming URI, once it listens."""
    uri = f"tcp://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("wyoming") / "bridge.log"
    cmd = [str(PYTHON), "-m", "wyoming_openai", "--uri", uri,
           "--tts-openai-url", custom_voice_server.url + "/v1", "--tts-openai-key", "not-needed",
           "--tts-models", "tts-1", "--tts-streaming-models", "gpt-4o-mini-tts"]
    with Background(cmd, log, lambda: "Starting server at" in log.read_text(errors="replace"), timeout=60):
        yield uri


@pytest.fixture(scope="module")
def programs(bridge) -> dict[str, list[str]]:
    return json.loads(run_client(PYTHON, SPEAK, "--uri", bridge, "--describe").stdout)


def test_the_bridge_offers_openai_voices_for_both_models(programs):
    assert {"alloy (tts-1)", "alloy (gpt-4o-mini-tts)"} <= {v for voices in programs.values() for v in voices}


@pytest.mark.parametrize("voice, stream", [(None, False), ("alloy (tts-1)", False), ("nova (gpt-4o-mini-tts)", False),
                                           ("cedar", True)])
def test_home_assistant_speaks_through_the_bridge(bridge, programs, tmp_path, voice, stream):
    """One synthesize event, or Home Assistant 2025.7+'s streamed text (two sentences: two requests)."""
    text = f"{TEXT} {TEXT}" if stream else TEXT
    out = tmp_path / "wyoming.wav"
    args = ["--voice", voice] if voice else []
    run_client(PYTHON, SPEAK, text, "-o", out, "--uri", bridge, *args,
               *(["--stream"] if stream else []))
    assert_complete_audio(out.read_bytes(), "wav", seconds=SECONDS * (2 if stream else 1))

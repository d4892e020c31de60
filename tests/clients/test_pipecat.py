"""Pipecat 1.14's own `OpenAITTSService` inside a real `Pipeline` (examples/pipecat_tts.py, run with the Pipecat
environment's Python) against `q3tts serve`. Pipecat sends only OpenAI's voice names and asks for 24 kHz PCM: on the
tiny CustomVoice model they map to its speakers, on the tiny Base model to the server's --default-voice. Each run
must end with the whole request's audio and no error frame."""

from __future__ import annotations

import pytest

from tests.clients.harness import EXAMPLES, TEXT, assert_complete_audio, client_python, run_client

PYTHON = client_python("pipecat")


@pytest.mark.parametrize("server, options", [("custom_voice_server", []),
                                             ("custom_voice_server", ["--voice", "verse", "--model", "tts-1"]),
                                             ("base_server", [])], ids=["defaults", "verse-tts-1", "base"])
def test_a_pipecat_pipeline_speaks(request, tmp_path, server, options):
    out = tmp_path / "pipecat.wav"
    run_client(PYTHON, EXAMPLES / "pipecat_tts.py", TEXT, "-o", out,
               "--base-url", request.getfixturevalue(server).url + "/v1", *options)
    assert_complete_audio(out.read_bytes(), "wav")

"""Pipecat 1.14's own `OpenAITTSService` inside a real `Pipeline` (examples/pipecat_tts.py, run with the Pipecat
environment's Python) against `q3tts serve` of the tiny CustomVoice model. Pipecat sends only OpenAI's voice names
and asks for 24 kHz PCM; each run must end with the whole request's audio and no error frame."""

from __future__ import annotations

import pytest

from tests.clients.harness import EXAMPLES, TEXT, assert_complete_audio, client_python, run_client


@pytest.mark.parametrize("options", [[], ["--voice", "verse", "--model", "tts-1"]], ids=["defaults", "verse-tts-1"])
def test_a_pipecat_pipeline_speaks(custom_voice_server, tmp_path, options):
    out = tmp_path / "pipecat.wav"
    run_client(client_python("pipecat"), EXAMPLES / "pipecat_tts.py", TEXT, "-o", out,
               "--base-url", custom_voice_server.url + "/v1", *options)
    assert_complete_audio(out.read_bytes(), "wav")

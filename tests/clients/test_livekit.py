"""LiveKit Agents' OpenAI plugin (livekit-plugins-openai 1.8.9): `openai.TTS(base_url=...).synthesize(text)`, as an
agent session calls it (examples/livekit_tts.py, run with the LiveKit environment's Python), against `q3tts serve`
of the tiny CustomVoice model: the plugin's defaults (voice `ash`, gpt-4o-mini-tts, so mp3 over SSE), tts-1 (its
raw-audio path) and the formats whose decoders differ.

LiveKit ends each segment with a 10 ms frame of silence when the last audio frame was already sent, so a decoded
segment may be up to 240 samples longer than the request's audio. Its FLAC decoder (ffmpeg with probesize 32 and
no buffering) drops the last ~0.1 s of any FLAC stream, libsndfile's too, so FLAC is not a format to use with it and
is not tested here (docs/clients.md says so)."""

from __future__ import annotations

import json
import wave

import pytest

from tests.clients.harness import REPO, SAMPLE_RATE, SECONDS, TEXT, client_python, run_client

CASES = {"defaults": {}, "tts-1": {"model": "tts-1"}, "pcm": {"response_format": "pcm", "voice": "alloy"},
         "wav": {"response_format": "wav", "voice": "nova"}, "opus": {"response_format": "opus"}}
END_MARKER = SAMPLE_RATE // 100  # the plugin's 10 ms end-of-segment frame

PYTHON = client_python("livekit")


@pytest.fixture(scope="module")
def results(custom_voice_server, tmp_path_factory):
    """Every case in one LiveKit process (it takes seconds to import): [(error, wav path)]."""
    out = tmp_path_factory.mktemp("livekit")
    proc = run_client(PYTHON, REPO / "tests/clients/drivers/livekit_cases.py",
                      custom_voice_server.url + "/v1", TEXT, json.dumps(list(CASES.values())), out,
                      pythonpath=REPO / "examples")
    errors = [json.loads(line)["error"] for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(errors) == len(CASES), proc.stdout
    return [(error, out / f"{i}.wav") for i, error in enumerate(errors)]


@pytest.mark.parametrize("case", list(CASES))
def test_livekit_synthesize(results, case):
    error, path = results[list(CASES).index(case)]
    assert error is None
    with wave.open(str(path)) as f:
        samples, rate = f.getnframes(), f.getframerate()
    assert rate == SAMPLE_RATE
    expected = round(SECONDS * SAMPLE_RATE)
    if CASES[case].get("response_format") in ("pcm", "wav"):  # lossless: every sample
        assert expected <= samples <= expected + END_MARKER, samples
    else:  # the encoders pad by up to a frame
        assert abs(samples - expected) <= SAMPLE_RATE * 0.08 + END_MARKER, samples

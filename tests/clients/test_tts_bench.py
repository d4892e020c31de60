"""The field's open-loop benchmark, nari-labs' tts-bench (vendored at a pinned commit: tests/clients/vendor), runs
`bench run` over HTTP against `q3tts serve` of the tiny CustomVoice model for each of its five targets, with their
own wire contracts (vLLM-Omni: stream + stream_format audio + pcm; SGLang-Omni: pcm and an x-sample-rate header;
VoxServe and nari: pcm; M*: a streamed WAV with open-ended sizes, parsed as it arrives). Its defaults otherwise
(model Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice, the hub id of the tiny model's kind and size; voice Ryan; language
English); two requests a second apart. By tts-bench's own summary every request must succeed
(complete PCM, no stall past its limits), and every WAV it saved must hold the whole request's audio."""

from __future__ import annotations

import json

import pytest

from tests.clients.harness import SECONDS, assert_complete_audio, client_python, run_client

TARGETS = ["vllm-omni", "sglang-omni", "voxserve", "mstar", "nari"]
PROMPTS = [{"id": "greeting", "text": "Hello from the benchmark."}, {"id": "second", "text": "A second short prompt."}]

PYTHON = client_python("tts-bench")


@pytest.mark.parametrize("target, transport", [*((t, "http") for t in TARGETS), ("nari", "websocket")])
def test_tts_bench_run_succeeds_on_every_request(custom_voice_server, tmp_path, target, transport):
    """(`--transport websocket`: nari's nari.speech.v1 at /v1/audio/speech/ws, a word every 10 ms into one live
    request.)"""
    dataset, out = tmp_path / "prompts.jsonl", tmp_path / "result"
    dataset.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    run_client(PYTHON, "-m", "tts_bench", "run", "--target", target, "--transport", transport,
               "--base-url", custom_voice_server.url, "--dataset", dataset,
               "--rps", "1", "--warmup", "0", "--duration", "2s", "--arrival", "constant", "--timeout", "60s",
               "--output", out)
    summary = json.loads((out / "summary.json").read_text())
    counts = {k: summary[k] for k in ("started_requests", "pcm_complete_requests", "audio_successful_requests",
                                      "successful_requests")}
    failures = [r["error_message"] for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())
                if not r["success"]]
    # Every request started and got all its audio; playback stalls are this CPU's pace, not the protocol's (the tiny
    # model runs ~2-3x real time alone here, and a busy machine takes that below 1x: tts-bench counts an underrun of
    # over 0.5 s a failure; on the GPU, bench/tts_bench's runs count them), so they alone are let pass.
    assert counts["started_requests"] == counts["pcm_complete_requests"] == 2, (counts, failures)
    assert all(f.startswith("audio stalled") for f in failures), failures
    assert counts["audio_successful_requests"] == counts["successful_requests"] == 2 - len(failures), counts
    manifest = [json.loads(line) for line in (out / "audio-manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == 2
    for entry in manifest:
        assert entry["audio_duration_ns"] == round(SECONDS * 1e9)
        assert_complete_audio((out / entry["wav_path"]).read_bytes(), "wav")

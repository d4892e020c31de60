"""`q3tts serve --devices`: one engine process per device behind one endpoint. The parts (metrics merging, the
least-loaded pick, flags handed to the engines, a voices folder shared between stores) and then the whole of it:
a real front over two CPU engines (tiny Base model), driven by the openai client, httpx and a WebSocket, with an
engine killed mid-stream."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")

import httpx  # noqa: E402
import openai  # noqa: E402
import soundfile as sf  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from q3tts.cli.commands import build_parser, engine_devices  # noqa: E402
from q3tts.request.voice import Voice  # noqa: E402
from q3tts.server import ServerConfig  # noqa: E402
from q3tts.server.errors import APIError  # noqa: E402
from q3tts.server.front.app import ENGINE_DRAIN_MARGIN_S, Backend, Backends, engine_args, merged_metrics  # noqa: E402
from q3tts.server.front.link import CoreUnavailable  # noqa: E402
from q3tts.server.voice_store import VoiceStore  # noqa: E402
from tests.server.harness import FRAME, SEED, children, frames, free_port, speak_over_websocket  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "router-test-key"

ENGINE_METRICS = """# HELP q3tts_running_streams Requests generating now
# TYPE q3tts_running_streams gauge
q3tts_running_streams {running}
# HELP q3tts_requests_total HTTP responses
# TYPE q3tts_requests_total counter
q3tts_requests_total{{route="/v1/audio/speech",method="POST",status="200"}} {ok}
# HELP q3tts_requests_created HTTP responses
# TYPE q3tts_requests_created gauge
q3tts_requests_created{{route="/v1/audio/speech",method="POST",status="200"}} 1.7e+09
# HELP q3tts_time_to_first_audio_seconds Submission to first audio frame
# TYPE q3tts_time_to_first_audio_seconds histogram
q3tts_time_to_first_audio_seconds_bucket{{le="0.05"}} {fast}
q3tts_time_to_first_audio_seconds_bucket{{le="+Inf"}} {ok}
q3tts_time_to_first_audio_seconds_count {ok}
q3tts_time_to_first_audio_seconds_sum 0.5
"""


def test_metrics_per_engine_and_summed():
    text = merged_metrics([ENGINE_METRICS.format(running=2, ok=5, fast=3),
                           ENGINE_METRICS.format(running=1, ok=7, fast=7)]).decode()
    samples = {(s.name, s.labels.get("engine"), s.labels.get("le")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("q3tts_running_streams", "0", None)] == 2 and samples[("q3tts_running_streams", "1", None)] == 1
    assert samples[("q3tts_running_streams", "all", None)] == 3
    assert samples[("q3tts_requests_total", "all", None)] == 12
    assert samples[("q3tts_time_to_first_audio_seconds_bucket", "all", "0.05")] == 10
    assert samples[("q3tts_time_to_first_audio_seconds_sum", "all", None)] == 1.0
    assert "_created" not in text  # per-process timestamps: summing them means nothing
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families)) == 3  # each family once, its samples together


def test_least_loaded_ready_engine_is_picked():
    engines = [Backend(i, f"cuda:{i}", f"http://127.0.0.1:{9000 + i}", ready=True) for i in range(3)]
    engines[0].core = SimpleNamespace(streams=dict.fromkeys(range(4)))  # 4 speech requests under way there
    engines[1].sessions = 1  # a WebSocket session
    engines[2].core = SimpleNamespace(streams={7: None})
    backends = Backends(engines)
    assert [e.in_flight for e in engines] == [4, 1, 1]
    assert backends.pick().index == 1  # the least loaded; of equals, the first
    engines[1].sessions += 1
    assert backends.pick().index == 2  # counted as they start and end, not at a poll
    engines[1].ready = engines[2].healthy = False
    assert backends.pick().index == 0
    with pytest.raises(APIError, match="loading"):  # engine 1 is alive but not ready yet
        backends.pick(exclude=(engines[0],))
    engines[0].healthy = engines[1].healthy = False
    with pytest.raises(APIError, match="no engine is serving"):
        backends.pick()


def test_a_request_an_engine_does_not_take_goes_to_the_next():
    engines = [Backend(i, f"cuda:{i}", f"http://127.0.0.1:{9000 + i}", ready=True) for i in range(2)]
    asked = []

    async def unreachable(body, request_id):
        asked.append(0)
        raise CoreUnavailable("gone")

    async def takes(body, request_id):
        asked.append(1)
        return "speech"

    engines[0].speak, engines[1].speak = unreachable, takes
    backends = Backends(engines)
    assert asyncio.run(backends.speak(None, "r")) == "speech" and asked == [0, 1]
    assert not engines[0].ready and engines[1].ready  # out of rotation until a poll finds it ready
    backends.stopping = True
    with pytest.raises(APIError, match="shutting down"):
        asyncio.run(backends.speak(None, "r"))


def test_engines_get_the_fronts_settings():
    config = ServerConfig(model="tiny", max_running=3, max_waiting=9, max_input_chars=100, max_context=512,
                          kv_cache_gb=0.5, prefix_cache_gb=0.125, served_model_name="tts-1", allow_ref_audio_urls=True,
                          ref_audio_hosts=("a.example",), send_timeout_s=4, drain_timeout_s=5, body_timeout_s=6,
                          runaway_guard=None, dtype="float32", api_key="secret",
                          voice_aliases={"alloy": "ryan", "Boss": "A deep, slow voice, calm."}, default_voice="aiden")
    args = build_parser().parse_args(["serve", "tiny", *engine_args(config, "warning")])
    assert "secret" not in engine_args(config, "warning")  # the key goes by environment, not argv
    assert (args.max_running, args.max_waiting, args.max_input_chars, args.max_context, args.kv_cache_gb,
            args.prefix_cache_gb) == (3, 9, 100, 512, 0.5, 0.125)
    assert (args.served_model_name, args.allow_ref_audio_urls, args.ref_audio_hosts, args.dtype) == \
        ("tts-1", True, "a.example", "float32")
    assert (args.send_timeout, args.body_timeout, args.no_runaway_guard) == (4, 6, True)
    assert args.drain_timeout == 5 + ENGINE_DRAIN_MARGIN_S  # (the front cuts first: see the test below)
    assert args.max_body_bytes == config.max_body_bytes and args.log_level == "warning"
    assert (args.voice_alias, args.default_voice) == (["alloy=ryan", "Boss=A deep, slow voice, calm."], "aiden")


@pytest.mark.parametrize("flags, expected", [
    (["--data-parallel", "2"], ["cuda:0", "cuda:1"]), (["--devices", "cuda:1, cuda:3"], ["cuda:1", "cuda:3"]),
    (["--devices", "cpu,cpu"], ["cpu", "cpu"]), (["--device", "cpu"], []), (["--single-process"], []),
    (["--data-parallel", "0"], "N >= 1"), (["--devices", ","], "comma-separated"),
    (["--devices", "gpu0"], "not a device"), (["--devices", "cuda:0,cuda:0"], "GPU twice"),
    (["--single-process", "--devices", "cpu"], "does not go with")])
def test_device_flags(flags, expected):
    args = build_parser().parse_args(["serve", "tiny", *flags])
    if isinstance(expected, list):
        assert engine_devices(args) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            engine_devices(args)


@pytest.mark.parametrize("flags, expected", [([], ["cuda"]), (["--device", "cuda:1"], ["cuda:1"]),
                                            (["--single-process"], []), (["--core-socket", "/tmp/e.sock"], [])])
def test_one_gpu_is_served_by_a_front_and_an_engine_process(monkeypatch, flags, expected):
    """On a GPU, `q3tts serve` is a front over one engine process unless told otherwise (or it is that engine)."""
    monkeypatch.setattr("q3tts.api.loading.resolve_device", lambda device: torch.device("cuda"))
    assert engine_devices(build_parser().parse_args(["serve", "tiny", *flags])) == expected


def test_device_and_devices_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "tiny", "--device", "cpu", "--devices", "cpu,cpu"])
    assert "not allowed with" in capsys.readouterr().err


def test_stores_sharing_a_folder_see_each_others_voices(tmp_path):
    first, second = VoiceStore(tmp_path), VoiceStore(tmp_path)
    voice = Voice(ref_code=None, ref_spk_embedding=torch.ones(8), x_vector_only_mode=True, icl_mode=False)
    entry = first.add(voice, name="shared")
    assert second.get("shared")[0].id == entry.id and [e.id for e in second.list()] == [entry.id]
    first.delete(entry.id)
    assert second.get(entry.id) is None and second.list() == []


# ---- the whole front over two engine processes ----------------------------------------------------------------

def _reference_wav() -> bytes:
    t = np.arange(24000) / 24000
    wav = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 4 * t))
    out = io.BytesIO()
    sf.write(out, wav.astype(np.float32), 24000, format="WAV")
    return out.getvalue()


def _is_ready(url: str) -> bool:
    with suppress(httpx.HTTPError):
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    return False


def _frames_by_engine(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "q3tts_frames_generated" for s in f.samples}


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the engine processes through /proc")
@pytest.mark.slow(reason="a front and two engine processes start, one is killed and started again (tests/SLOW.md)")
def test_two_engines_behind_one_endpoint(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "front.log"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", "Q3TTS_API_KEY": KEY,
           "TMPDIR": str(tmp_path / "tmp")}
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", "tiny-base", "--devices", "cpu,cpu", "--port", str(port),
           "--max-context", "4096", "--voices-dir", str(tmp_path / "voices"), "--log-level", "warning",
           "--drain-timeout", "5", "--no-runaway-guard"]
    with log.open("w") as out:
        front = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    auth = {"Authorization": f"Bearer {KEY}"}
    engines: list[int] = []
    try:
        started = time.monotonic()
        while True:
            assert front.poll() is None, log.read_text()[-3000:]
            engines[:] = children(front.pid)  # for the cleanup, whatever happens
            if _is_ready(url):
                break
            assert time.monotonic() - started < 240, log.read_text()[-3000:]
            time.sleep(0.2)
        ready_s = time.monotonic() - started
        ready = httpx.get(url + "/ready").json()
        assert [e["device"] for e in ready["engines"]] == ["cpu", "cpu"]
        assert len(engines) == 2

        # The front authenticates; voices are uploaded once and every engine speaks with them.
        assert httpx.get(url + "/v1/audio/voices").status_code == 401
        created = httpx.post(url + "/v1/audio/voices", headers=auth, data={"x_vector_only_mode": "true",
                             "name": "shared"}, files={"file": ("ref.wav", _reference_wav(), "audio/wav")},
                             timeout=60)
        assert created.status_code == 201, created.text
        # Through the front as in one process: a name with a space or beyond ASCII reaches the engine encoded (once
        # a plain-text 400 or a 500); a lone surrogate and an infinite temperature are refused (once a 500, and
        # a temperature silently dropped for the default).
        for name, path in (("my voice", "my%20voice"), ("José", "Jos%C3%A9")):
            made = httpx.post(url + "/v1/audio/voices", headers=auth, data={"x_vector_only_mode": "true", "name": name},
                              files={"file": ("ref.wav", _reference_wav(), "audio/wav")}, timeout=60)
            assert made.status_code == 201, made.text
            assert httpx.get(f"{url}/v1/audio/voices/{path}", headers=auth).json()["name"] == name
            assert httpx.delete(f"{url}/v1/audio/voices/{path}", headers=auth).status_code == 200
        for body, param in ((b'{"input": "\\ud800", "voice": "shared"}', "input"),
                            (b'{"input": "Hi.", "voice": "shared", "temperature": Infinity}', "temperature")):
            refused = httpx.post(url + "/v1/audio/speech", content=body,
                                 headers={**auth, "content-type": "application/json"}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        results = []

        def speak(max_new: int) -> None:
            audio = client.audio.speech.create(model="tiny-base", voice="shared", input="Hello from both engines.",
                                               response_format="pcm", extra_body={"max_new_tokens": max_new,
                                                                                  "seed": SEED})
            results.append(len(audio.content) // 2 == frames(max_new) * FRAME)

        before = _frames_by_engine(url)  # the engines' warm-up requests
        threads = [threading.Thread(target=speak, args=(40,)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 6
        time.sleep(0.3)  # a poll
        by_engine = {k: v - before[k] for k, v in _frames_by_engine(url).items()}
        assert by_engine["0"] > 0 and by_engine["1"] > 0, by_engine  # concurrent requests are spread
        assert by_engine["all"] == by_engine["0"] + by_engine["1"] == 6 * frames(40)

        # A WebSocket session goes through too.
        events, audio = speak_over_websocket(url, "shared", "Through the front.", 5, headers=auth)
        assert events[0] == "session.created" and events[-1] == "session.done" and audio == 2 * frames(5) * FRAME

        # One engine killed while both stream: its stream ends cut off, the other's completes, the rest keep
        # serving, /ready says no (and /health yes) until the engine is back.
        outcomes: dict[int, str] = {}

        def long_stream(i: int) -> None:
            body = {"model": "tiny-base", "voice": "shared", "input": "A long one.", "response_format": "pcm",
                    "max_new_tokens": 300, "seed": SEED}
            try:
                with httpx.stream("POST", url + "/v1/audio/speech", json=body, headers=auth, timeout=120) as r:
                    n = sum(len(c) for c in r.iter_bytes())
                outcomes[i] = "complete" if n == 2 * frames(300) * FRAME else f"short {n}"
            except httpx.HTTPError as e:
                outcomes[i] = f"cut: {type(e).__name__}"

        streams = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 60
        while _frames_by_engine(url)["all"] < before["all"] + 6 * frames(40) + 2 * 20:  # both under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engines[1], signal.SIGKILL)
        killed = time.monotonic()
        while httpx.get(url + "/ready").status_code == 200:
            assert time.monotonic() - killed < 2, "the front did not notice"
            time.sleep(0.02)
        assert httpx.get(url + "/health").status_code == 200
        for _ in range(4):
            speak(6)
        assert results[-4:] == [True] * 4
        for t in streams:
            t.join()
        assert sorted(o.split(":")[0] for o in outcomes.values()) == ["complete", "cut"], outcomes
        while (ready := httpx.get(url + "/ready")).status_code != 200:
            assert time.monotonic() - killed < 120, ready.json()
            time.sleep(0.2)
        back = time.monotonic() - killed
        assert [e["restarts"] for e in ready.json()["engines"]] == [0, 1]
        for _ in range(2):
            speak(6)
        assert results[-2:] == [True] * 2
        engines[:] = children(front.pid)

        assert len(list((tmp_path / "tmp").glob("q3tts-*/engine*.sock"))) == 2  # the engines' sockets
        front.send_signal(signal.SIGTERM)
        assert front.wait(timeout=30) == 0
        assert not list((tmp_path / "tmp").glob("q3tts-*"))  # removed at exit
        assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                       for pid in engines)
        print(f"\n--devices cpu,cpu: ready in {ready_s:.0f} s; 6 requests spread "
              f"{by_engine['0']:.0f}/{by_engine['1']:.0f} frames; engine killed mid-stream: {outcomes}, "
              f"back in rotation after {back:.1f} s")
    finally:
        for pid in [front.pid, *engines]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        front.wait()


def test_an_engine_that_cannot_start_stops_the_front(tmp_path):
    """A checkpoint that does not load (a tensor missing: whole files, so the command's own checks pass it) fails
    every start of an engine alike: the front does not start it again, and with no engine left it exits 1 with
    the engine's reason in its log (as one process does)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from q3tts.tiny import tiny_checkpoint

    folder = Path(shutil.copytree(tiny_checkpoint("tiny", tmp_path / "cache"), tmp_path / "ckpt"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["talker.codec_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", str(folder), "--devices", "cpu", "--port",
           str(free_port()), "--log-level", "warning"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "talker.codec_head.weight" in done.stderr and "before it was ready" in done.stderr
    assert done.stderr.count("exited with") == 1  # not started again
    assert time.monotonic() - started < 60 and not list(tmp_path.glob("q3tts-*"))


def test_the_front_logs_for_its_user(tmp_path):
    """At the default log level a front says when its engine starts and is ready, and its engine does not log the
    front's polls (20 a second) nor an internal address to connect to."""
    port = free_port()
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", "tiny", "--devices", "cpu", "--port", str(port)]
    env = {**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "front.log"
    with log.open("w") as out:
        front = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        started = time.monotonic()
        while "engine 0 (cpu) ready" not in log.read_text():
            assert front.poll() is None and time.monotonic() - started < 120, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)  # ~20 polls
    finally:
        front.send_signal(signal.SIGTERM)
        front.wait(timeout=30)
    text = log.read_text()
    assert "engine 0 (cpu): starting" in text and f"Uvicorn running on http://127.0.0.1:{port}" in text
    assert "GET /ready" not in text and "GET /health" not in text
    assert text.count("Uvicorn running on") == 1


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the engine process through /proc")
def test_a_signal_to_front_and_engine_at_once_is_a_clean_drain(tmp_path):
    """systemd's stop (or Ctrl-C in a terminal) signals the front and its engine process together. With streams
    still running at the drain timeout, the front cuts them, a line each, exits 0, and nothing is logged as an
    engine's failure: the engine drains longer than its front. (The engine is signalled first here, the order in
    which it used to cut the streams itself, each then logged by the front as failed mid-stream, with a traceback;
    and the front's polls of the draining engine left a refused connection's exception unretrieved.)"""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", "tiny", "--devices", "cpu", "--port", str(port),
           "--drain-timeout", "2", "--no-runaway-guard"]
    env = {**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "front.log"
    with log.open("w") as out:
        front = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    received: list[int] = []
    try:
        started = time.monotonic()
        while not _is_ready(url):
            assert front.poll() is None and time.monotonic() - started < 120, log.read_text()[-3000:]
            time.sleep(0.2)
        engines = children(front.pid)

        def stream() -> None:
            body = {"model": "tiny", "voice": "ryan", "input": "A long one.", "response_format": "pcm",
                    "max_new_tokens": 4000, "seed": SEED}
            with suppress(httpx.HTTPError), httpx.stream("POST", url + "/v1/audio/speech", json=body,
                                                         timeout=60) as r:
                for chunk in r.iter_bytes():
                    received.append(len(chunk))

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        while len(received) < 2:
            assert time.monotonic() - started < 180, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(engines[0], signal.SIGTERM)
        time.sleep(0.5)
        front.send_signal(signal.SIGTERM)
        assert front.wait(timeout=60) == 0, log.read_text()[-3000:]
        for t in threads:
            t.join(timeout=30)
    finally:
        if front.poll() is None:
            front.kill()
    text = log.read_text()
    assert "cancelled before it ended" in text, text[-3000:]  # (a stream still ran when the front cut: the case)
    assert "failed mid-stream" not in text and "Traceback" not in text and "never retrieved" not in text, text[-3000:]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the engine process through /proc")
@pytest.mark.parametrize("when", ["starting", "serving"])
def test_an_engine_does_not_outlive_its_front(tmp_path, when):
    """A front killed outright (no chance to stop its engines): its engine process notices and exits, instead of
    holding its device for good. Killed while its engine process still starts (imports, loads), the front used to
    be missed: the engine read its parent's id only as its app started, by then the process that adopted it."""
    port = free_port()
    cmd = [sys.executable, "-m", "q3tts.cli", "serve", "tiny", "--devices", "cpu", "--port", str(port),
           "--log-level", "warning"]
    env = {**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "front.log"
    with log.open("w") as out:
        front = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    started = time.monotonic()
    while not (engines := children(front.pid)):
        assert front.poll() is None and time.monotonic() - started < 60, log.read_text()[-3000:]
        time.sleep(0.05)
    while when == "serving" and not _is_ready(f"http://127.0.0.1:{port}"):
        assert front.poll() is None and time.monotonic() - started < 120, log.read_text()[-3000:]
        time.sleep(0.2)
    front.kill()
    front.wait()
    killed = time.monotonic()
    alive = lambda pid: Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
    while alive(engines[0]):  # (starting: it notices once its app starts; ~18 s on 2 busy cores, bytecode cold)
        if time.monotonic() - killed > 60:
            os.kill(engines[0], signal.SIGKILL)
            raise AssertionError("the engine process outlived its front by 60 s\n" + log.read_text()[-3000:])
        time.sleep(0.2)
    assert "the front" in log.read_text() and "is gone" in log.read_text()

"""q3tts on Ray Serve (`q3tts.ray_serve`): its arguments, then a real local Ray cluster on the CPU with two
replicas of the tiny Base model behind Ray's proxy, driven by the openai client, httpx and a WebSocket, with one
replica killed mid-test."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import httpx  # noqa: E402
import openai  # noqa: E402
import soundfile as sf  # noqa: E402

from q3tts.ray_serve import build_app  # noqa: E402
from q3tts.tiny import tiny_checkpoint  # noqa: E402
from tests.server.harness import FRAME, SEED, frames, free_port, speak_over_websocket  # noqa: E402

MAX_NEW = 8


@pytest.mark.parametrize("args, message", [
    ({}, "`model` argument is required"),
    ({"model": "m", "colour": "blue"}, "unknown argument.*colour"),
    ({"model": "m", "num_replicas": 2, "max_replicas": 3}, "either num_replicas or the autoscaling"),
    ({"model": "m", "num_replicas": 2}, "voices_dir"),
    ({"model": "m", "max_replicas": 4}, "voices_dir"),
    ({"model": "m", "num_replicas": 0}, "at least one replica"),
    ({"model": "m", "max_running": "many"}, "max_running='many'"),
    ({"model": "m", "runaway_guard": "perhaps"}, "expected true or false"),
    ({"model": "m", "num_gpus": -1}, "num_gpus must be >= 0"),
    ({"model": "m", "max_waiting": 0}, "max_waiting must be >= 1"),
    ({"model": "m", "voice_aliases": "alloy"}, "expected NAME=VOICE"),
])
def test_bad_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_arguments_become_deployment_options(tmp_path):
    app = build_app({"model": "m", "num_gpus": "1", "max_running": "32", "max_waiting": "100", "min_replicas": "1",
                     "max_replicas": "8", "voices_dir": str(tmp_path), "runaway_guard": "false", "api_key": "k"})
    deployment = app._bound_deployment
    assert deployment.ray_actor_options["num_gpus"] == 1
    assert deployment.max_ongoing_requests == 132 and deployment.max_queued_requests == 100
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (1, 8, 32)
    config = app._bound_deployment.init_args[0]
    assert (config.device, config.max_running, config.runaway_guard, config.api_key) == ("cuda", 32, None, "k")
    aliased = build_app({"model": "m", "voice_aliases": "alloy=ryan, ash=vivian", "default_voice": "ryan"})
    config = aliased._bound_deployment.init_args[0]
    assert (config.voice_aliases, config.default_voice) == ({"alloy": "ryan", "ash": "vivian"}, "ryan")
    mapping = build_app({"model": "m", "voice_aliases": {"alloy": "A calm voice, low and slow."}})
    assert mapping._bound_deployment.init_args[0].voice_aliases == {"alloy": "A calm voice, low and slow."}


# ---- a real local cluster ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = tiny_checkpoint("tiny-base", tmp_path_factory.mktemp("cache"))
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"model": str(model), "num_gpus": 0, "num_cpus": 0.5, "num_replicas": 2,
                         "voices_dir": str(tmp_path_factory.mktemp("voices")), "max_running": 4, "max_waiting": 16,
                         "max_context": 1024, "served_model_name": "tiny-base"})
        started = time.monotonic()
        serve.run(app, name="q3tts", route_prefix="/")
        print(f"\nray serve: 2 replicas running in {time.monotonic() - started:.1f} s")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replicas() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::q3tts#"))


def _running() -> int:
    return serve.status().applications["q3tts"].deployments["q3tts"].replica_states.get("RUNNING", 0)


def _reference_wav() -> bytes:
    t = np.arange(24000) / 24000
    out = io.BytesIO()
    sf.write(out, (0.3 * np.sin(2 * np.pi * 180 * t) * (1 + np.sin(2 * np.pi * 4 * t))).astype(np.float32), 24000,
             format="WAV")
    return out.getvalue()


@pytest.fixture(scope="module")
def voice(cluster) -> str:
    created = httpx.post(cluster + "/v1/audio/voices", data={"x_vector_only_mode": "true", "name": "ray"},
                         files={"file": ("ref.wav", _reference_wav(), "audio/wav")}, timeout=60)
    assert created.status_code == 201, created.text
    return created.json()["id"]


def _speak(url: str, voice: str, max_new: int = MAX_NEW) -> int:
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    with client.audio.speech.with_streaming_response.create(
            model="tiny-base", voice=voice, input="Hello from a Ray replica.", response_format="pcm",
            extra_body={"max_new_tokens": max_new, "seed": SEED}) as response:
        return sum(len(chunk) for chunk in response.iter_bytes()) // 2


def test_the_openai_api_through_ray_serve(cluster, voice):
    assert _running() == 2
    models = httpx.get(cluster + "/v1/models").json()["data"]
    assert models[0]["task_type"] == "Base"
    results = []
    threads = [threading.Thread(target=lambda: results.append(_speak(cluster, voice))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [frames(MAX_NEW) * FRAME] * 6  # the voice, stored once, is found on both replicas
    bad = httpx.post(cluster + "/v1/audio/speech", json={"input": "x", "voice": voice, "speed": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speed"  # q3tts's own errors pass through


def test_websocket_sessions_through_ray_serve(cluster, voice):
    events, audio = speak_over_websocket(cluster, voice, "Through Ray.", 5)
    assert events[0] == "session.created" and events[-1] == "session.done" and audio == 2 * frames(5) * FRAME


def test_a_killed_replica_is_replaced_and_the_service_keeps_answering(cluster, voice):
    before = _replicas()
    assert len(before) == 2
    ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    answered = [_speak(cluster, voice) for _ in range(4)]
    assert answered == [frames(MAX_NEW) * FRAME] * 4
    while not (_running() == 2 and before[0] not in _replicas()):
        assert time.monotonic() - killed < 120, serve.status()
        time.sleep(0.5)
    replaced = time.monotonic() - killed
    assert _speak(cluster, voice) == frames(MAX_NEW) * FRAME
    print(f"\nray serve: replica killed; 4 requests answered meanwhile; replaced in {replaced:.1f} s")


def test_replicas_are_added_when_requests_queue(cluster, tmp_path):
    """Autoscaling on requests in flight: one replica, a target of one request each; four long streams at once
    bring a second replica up."""
    app = build_app({"model": str(tiny_checkpoint("tiny-base", tmp_path)), "num_gpus": 0, "num_cpus": 0.5,
                     "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0,
                     "downscale_delay_s": 600, "max_running": 2, "max_context": 4096, "runaway_guard": False,
                     "voices_dir": str(tmp_path / "voices"), "served_model_name": "tiny-base"})
    serve.run(app, name="autoscaled", route_prefix="/autoscaled")
    url = cluster + "/autoscaled"
    voice = httpx.post(url + "/v1/audio/voices", data={"x_vector_only_mode": "true"},
                       files={"file": ("ref.wav", _reference_wav(), "audio/wav")}, timeout=60).json()["id"]

    def replicas() -> int:
        return serve.status().applications["autoscaled"].deployments["q3tts"].replica_states.get("RUNNING", 0)

    assert replicas() == 1
    done = threading.Event()

    def long_stream() -> None:  # read until the test has seen the second replica, then leave
        body = {"input": "A long one.", "voice": voice, "response_format": "pcm", "max_new_tokens": 3000}
        with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=120) as response:
            for _ in response.iter_bytes():
                if done.is_set():
                    break

    streams = [threading.Thread(target=long_stream) for _ in range(4)]
    started = time.monotonic()
    for t in streams:
        t.start()
    try:
        while replicas() < 2:
            assert time.monotonic() - started < 90, serve.status().applications["autoscaled"]
            time.sleep(0.5)
    finally:
        done.set()
        for t in streams:
            t.join()
    print(f"\nray serve autoscaling: a second replica running {time.monotonic() - started:.1f} s after 4 streams")
    serve.delete("autoscaled")

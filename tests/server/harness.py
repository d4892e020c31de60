"""A real q3tts server (uvicorn, tiny model, CPU) in a background thread, for the server tests."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import uvicorn
from websockets.exceptions import ConnectionClosed

from q3tts import TTS
from q3tts.server import ServerConfig, create_app
from q3tts.server.app import uvicorn_options
from q3tts.tiny import tiny_checkpoint

FRAME = 1920  # samples per codec frame at 24 kHz
SEED = 7  # every request is seeded: the tiny random models then never sample EOS early (see frames())


def children(pid: int) -> list[int]:
    """The process ids of a process's children (a front's engine processes; Linux /proc)."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def frames(max_new_tokens: int) -> int:
    """Frames a request yields when it runs to its limit: max_new_tokens = N gives N - 1 (as official)."""
    return max_new_tokens - 1


def speak_over_websocket(base_url: str, voice: str, text: str, max_new_tokens: int,
                         headers: dict[str, str] | None = None) -> tuple[list[str], int]:
    """One WebSocket session (config, one text, done) on `base_url`: the event types in order, up to
    session.done or an error, and the bytes of audio received."""
    from websockets.sync.client import connect

    config = {"type": "session.config", "protocol": "q3tts",
              "voice": voice, "seed": SEED, "max_new_tokens": max_new_tokens}
    with connect(base_url.replace("http", "ws") + "/v1/audio/speech/stream", additional_headers=headers) as ws:
        for message in (config, {"type": "input.text", "text": text}, {"type": "input.done"}):
            ws.send(json.dumps(message))
        audio, events = 0, []
        while (message := ws.recv(timeout=60)) is not None:
            if isinstance(message, bytes):
                audio += len(message)
            else:
                events.append(json.loads(message)["type"])
                if events[-1] in ("session.done", "error"):
                    break
    return events, audio


class ServerThread:
    """`with ServerThread(config) as server:` serves on a free localhost port until the block ends."""

    def __init__(self, config: ServerConfig, tts: TTS | None = None, wait_ready: bool = True):
        config.port = free_port()
        self.config, self.wait_ready = config, wait_ready
        self.app = create_app(config, tts)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=config.port,
                                                    log_level="warning", **uvicorn_options(config)))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{config.port}"
        self.ws_url = f"ws://127.0.0.1:{config.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        if self.wait_ready:
            self.wait_until_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_until_ready(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while httpx.get(self.url + "/ready").status_code != 200:
            assert time.time() < deadline, "the server never became ready"
            time.sleep(0.05)

    @property
    def engine(self):
        return self.app.state.service.engine

    def wait_idle(self, timeout: float = 20) -> None:
        """Until the engine has no running or waiting request."""
        deadline = time.time() + timeout
        while self.engine.num_running or self.engine.num_waiting:
            assert time.time() < deadline, f"engine still busy: {self.engine.num_running} running"
            time.sleep(0.02)


def load_tiny(name: str, cache_dir: Path) -> TTS:
    return TTS.from_pretrained(tiny_checkpoint(name, cache_dir), device="cpu")


def decoded_samples(data: bytes) -> tuple[int, int]:
    """(samples, sample rate) of an encoded stream, decoded with PyAV."""
    container = av.open(io.BytesIO(data))
    got = [(f.samples, f.sample_rate) for f in container.decode(audio=0)]
    return sum(n for n, _ in got), got[0][1]


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events_until_close(ws) -> tuple[list[dict], bytes]:
    """A WebSocket session's JSON events and its audio, received until the server closes it."""
    events, audio = [], b""
    try:
        while True:
            message = ws.recv(timeout=60)
            if isinstance(message, bytes):
                audio += message
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        return events, audio

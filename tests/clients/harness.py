"""What the client tests share: real `q3tts serve` processes on tiny checkpoints, the clients' own environments, and
the checks that a response is complete, decodable audio.

The tiny random models never sample EOS, and most clients cannot pass `max_new_tokens`, so the served checkpoint
is a copy of a tiny one whose generation_config.json says `max_new_tokens` = MAX_NEW_TOKENS, greedily: every
request then yields exactly FRAMES frames whatever client sent it, which is what the tests count.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from q3tts.tiny import tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CLIENT_ENVS = Path(os.environ.get("Q3TTS_CLIENT_ENVS", REPO / ".venv-clients"))
SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920  # one codec frame, 80 ms at 24 kHz
MAX_NEW_TOKENS = 13
FRAMES = MAX_NEW_TOKENS - 1  # max_new_tokens = N gives N - 1 frames (as official)
SECONDS = FRAMES * FRAME_SAMPLES / SAMPLE_RATE
TEXT = "Hello from a client."


def client_python(name: str) -> Path:
    """The Python of the client environment `name` that scripts/client_envs.sh builds (.venv-clients/NAME). Called
    when a test module is imported, so that a missing one skips the module (fails it under Q3TTS_REQUIRE_CLIENTS=1)
    before any server starts."""
    python = CLIENT_ENVS / name / "bin" / "python"
    if not (CLIENT_ENVS / name / ".ready").exists() or not python.exists():
        message = f"the {name} client environment is not built: run `bash scripts/client_envs.sh`"
        if os.environ.get("Q3TTS_REQUIRE_CLIENTS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)
    return python


def run_client(python: Path, *args: str | os.PathLike, timeout: float = 120,
               pythonpath: str | os.PathLike = "") -> subprocess.CompletedProcess:
    """Runs a script or module with a client environment's Python (`pythonpath`: the only folder added to its
    sys.path); fails the test with its output if it fails."""
    proc = subprocess.run([str(python), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(pythonpath), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def voice_sample(pitch_hz: float = 180) -> bytes:
    """Two seconds of a voice-like signal as a WAV file (the tiny Base model clones anything)."""
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * pitch_hz * t) * (1 + 0.5 * np.sin(2 * np.pi * 4 * t))
    out = io.BytesIO()
    sf.write(out, wave.astype(np.float32), SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


def limited_checkpoint(name: str, folder: Path) -> Path:
    """A copy of the tiny checkpoint `name` in `folder` that stops after FRAMES frames, greedily."""
    shutil.copytree(tiny_checkpoint(name, folder.parent / "tiny-cache"), folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, subtalker_dosample=False)
    path.write_text(json.dumps(config, indent=2))
    return folder


class Background:
    """A process for the length of a `with` block, its output in `log`: entered once `is_ready()` holds (failing with
    the log's end if the process exits or `timeout` passes first); stopped with SIGTERM, then SIGKILL."""

    def __init__(self, cmd: list[str], log: Path, is_ready, env: dict[str, str] | None = None, timeout: float = 180):
        self.cmd, self.log, self.is_ready, self.env, self.timeout = cmd, log, is_ready, env, timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Background:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=_die_with_parent)
        deadline = time.time() + self.timeout
        while not self.is_ready():
            assert self.proc.poll() is None, f"{self.cmd[:4]} exited {self.proc.returncode}:\n{self.log_tail()}"
            assert time.time() < deadline, f"{self.cmd[:4]} was not ready in {self.timeout} s:\n{self.log_tail()}"
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


class ServeProcess(Background):
    """`q3tts serve FOLDER` in a process of its own on a free localhost port, until its `with` block ends."""

    def __init__(self, folder: Path, served_model_name: str, log: Path, *args: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "q3tts.cli", "serve", str(folder), "--port", self.url.rsplit(":", 1)[1],
               "--device", "cpu", "--served-model-name", served_model_name, "--drain-timeout", "1", *args]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        super().__init__(cmd, log, self._ready, env)

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, however it dies (a killed pytest would
    otherwise leave its servers running). Linux only; elsewhere the fixtures' own stop must do."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decoded(data: bytes) -> tuple[int, int]:
    """(samples, sample rate) of an encoded stream, decoded whole with PyAV (ffmpeg); fails on a broken one."""
    with av.open(io.BytesIO(data)) as container:
        frames = [(f.samples, f.sample_rate) for f in container.decode(audio=0)]
    assert frames, "no audio frames decoded"
    return sum(n for n, _ in frames), frames[0][1]


def assert_complete_audio(data: bytes, response_format: str, sample_rate: int = SAMPLE_RATE,
                          seconds: float = SECONDS) -> None:
    """The whole request's audio, decoded: every sample of the lossless formats and of Opus (its stream says what
    to trim), and at least every sample of MP3 and AAC, which add their encoder's priming and pad to whole frames
    (measured: 1,024 to 1,536 samples at 8-48 kHz; allowed: two MP3 frames). Opus decodes at 48 kHz."""
    expected = round(seconds * sample_rate)
    if response_format == "pcm":
        assert len(data) % 2 == 0 and len(data) // 2 == expected, len(data)
        return
    samples, rate = decoded(data)
    if response_format == "opus":
        assert rate == 48000 and samples == round(seconds * rate), (rate, samples)
    elif response_format in ("mp3", "aac"):
        assert rate == sample_rate and expected <= samples <= expected + 2 * 1152, (rate, samples, expected)
    else:
        assert rate == sample_rate and samples == expected, (rate, samples, expected)

"""The `q3tts` command line on the built-in tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf

from q3tts.cli import main
from tests.test_equivalence import speech_like


@pytest.fixture(autouse=True)
def tiny_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("Q3TTS_CACHE", str(tmp_path_factory.getbasetemp() / "q3tts-cli-cache"))


def test_say_writes_a_wav(tmp_path, capsys):
    out = tmp_path / "hello.wav"
    assert main(["say", "Hello from q3tts.", "-o", str(out), "--model", "tiny", "--max-new-tokens", "9",
                 "--seed", "1"]) == 0
    wav, sr = sf.read(out)
    assert sr == 24000 and len(wav) == 8 * 1920
    assert "speaker ryan" in capsys.readouterr().err


def test_voice_create_then_say_with_it(tmp_path):
    ref = tmp_path / "ref.wav"
    sf.write(ref, speech_like(1.0, 16000, 9), 16000)
    voice = tmp_path / "me.voice"
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", str(ref), "--ref-text", "Good morning.",
                 "-o", str(voice)]) == 0
    out = tmp_path / "clone.wav"
    assert main(["say", "Thank you.", "--model", "tiny-base", "--voice", str(voice), "-o", str(out), "--greedy",
                 "--max-new-tokens", "5"]) == 0
    assert sf.info(out).frames == 4 * 1920


def test_say_modes_and_errors(tmp_path, capsys):
    out = tmp_path / "d.wav"
    assert main(["say", "Hello.", "--model", "tiny-voice-design", "--instruct", "A calm old man.", "-o", str(out),
                 "--max-new-tokens", "4", "--streaming-text"]) == 0
    assert main(["say", "Hello.", "--model", "tiny", "--speaker", "nobody", "-o", str(out)]) == 1
    assert "unknown speaker 'nobody'" in capsys.readouterr().err
    assert main(["say", "Hello.", "--model", "tiny-base", "-o", str(out)]) == 1
    assert "--ref-audio" in capsys.readouterr().err
    assert main(["say", "   ", "--model", "tiny", "-o", str(out)]) == 1
    assert "text is empty" in capsys.readouterr().err
    for name in ("out.xyz", "out"):  # refused before the model loads, not after the audio is made
        assert main(["say", "Hello.", "--model", "no-such-model", "-o", str(tmp_path / name)]) == 1
        assert "names no audio format" in capsys.readouterr().err
    assert main(["say", "Hello.", "--model", "tiny", "-o", str(tmp_path / "x.flac"), "--max-new-tokens", "3"]) == 0
    assert (tmp_path / "x.flac").stat().st_size > 0


def test_no_network_and_no_model_names_the_options(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["say", "Hello.", "-o", str(tmp_path / "x.wav")]) == 1
    err = capsys.readouterr().err
    assert "local folder" in err and "tiny" in err


def test_console_script_runs(tmp_path):
    """The installed `q3tts` entry point (what the README's first command runs)."""
    exe = os.path.join(os.path.dirname(sys.executable), "q3tts")
    out = tmp_path / "x.wav"
    proc = subprocess.run([exe, "say", "Hello.", "--model", "tiny", "-o", str(out), "--max-new-tokens", "3"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert sf.info(out).frames == 2 * 1920


def test_help_answers_without_loading_torch():
    """`q3tts --help` and the package's import answer at once: torch (~3 s) loads with the first name that needs it,
    and every public name is still there."""
    code = ("import sys, q3tts, q3tts.cli\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert q3tts.Qwen3TTSModel is q3tts.TTS and q3tts.TTS.__module__ == 'q3tts.api'\n"
            "assert all(getattr(q3tts, name) for name in q3tts.__all__)\n"
            "assert set(q3tts.__all__) <= set(dir(q3tts))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    exe = os.path.join(os.path.dirname(sys.executable), "q3tts")
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "say" in proc.stdout, proc.stderr


def test_benchmark_modules_import():
    """The benchmarks run only on the GPU machine; at least their imports are checked here."""
    import importlib
    import importlib.util

    for name in ("api", "common", "decode", "streaming"):
        importlib.import_module(f"q3tts.benchmarks.{name}")
    for path in sorted((Path(__file__).resolve().parent.parent / "bench").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_say_reads_a_file_or_standard_input_and_plays_if_it_can(tmp_path, capsys, monkeypatch):
    """Text from a file (a long one, spoken in pieces) or from standard input; --play without an audio output (or
    without the player installed) says so and still writes the file."""
    import io

    from q3tts.text_segmenter import split_text

    long_text = " ".join(f"Line {i} of a text read from a file, spoken in pieces." for i in range(14))
    (tmp_path / "text.txt").write_text(long_text, encoding="utf-8")
    out = tmp_path / "file.wav"
    assert main(["say", "-f", str(tmp_path / "text.txt"), "--model", "tiny", "--max-new-tokens", "3", "-o", str(out),
                 "--play", "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "cannot play" in err and sf.info(out).frames == 2 * 1920 * len(split_text(long_text))
    monkeypatch.setattr("sys.stdin", io.StringIO("From standard input."))
    assert main(["say", "-", "--model", "tiny", "--max-new-tokens", "3", "-o", str(tmp_path / "stdin.wav")]) == 0
    assert main(["say", "--model", "tiny", "-o", str(out)]) == 1
    assert "give the text to speak" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--max-running", "0"), ("--max-body-bytes", "0"), ("--body-timeout", "0"),
                                         ("--kv-cache-gb", "-1"), ("--max-waiting", "0")])
def test_serve_names_the_flag_at_fault(flag, value, capsys):
    """A bad setting stops `q3tts serve` before it loads anything, naming the flag (not the setting's Python name)."""
    assert main(["serve", "tiny", "--device", "cpu", flag, value]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"q3tts: error: {flag} must be"), err


def test_an_output_that_is_a_folder_is_refused_before_any_work(tmp_path, capsys):
    """(`voice create -o folder` once ended in safetensors' traceback after the whole cloning.)"""
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", "nowhere.wav", "-o", str(tmp_path)]) == 1
    assert f"-o {tmp_path}: that is a folder; give a file name" in capsys.readouterr().err
    assert main(["say", "Hello.", "--model", "tiny", "-o", str(tmp_path)]) == 1
    assert f"-o {tmp_path}: that is a folder" in capsys.readouterr().err

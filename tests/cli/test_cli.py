"""The `q3tts` command line on the built-in tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from q3tts.cli import main
from tests.equivalence.test_equivalence import speech_like


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


def test_sampling_flags_beside_greedy_are_a_warning_line(tmp_path, capsys):
    """Greedy decoding ignores the sampling flags: one warning line naming them as flags, and the audio."""
    out = tmp_path / "greedy.wav"
    assert main(["say", "Hello.", "-o", str(out), "--model", "tiny", "--max-new-tokens", "3", "--greedy",
                 "--temperature", "0.5", "--top-k", "3"]) == 0
    err = capsys.readouterr().err
    assert "q3tts: warning: --temperature, --top-k: used only when sampling, ignored with greedy decoding\n" in err
    assert sf.info(out).frames == 2 * 1920


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
            "assert q3tts.Qwen3TTSModel is q3tts.TTS and q3tts.TTS.__module__ == 'q3tts.api.tts'\n"
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
    for path in sorted((Path(__file__).resolve().parents[2] / "bench").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_say_reads_a_file_or_standard_input_and_plays_if_it_can(tmp_path, capsys, monkeypatch):
    """Text from a file (a long one, spoken in pieces) or from standard input; --play without an audio output (or
    without the player installed) says so and still writes the file."""
    import io

    from q3tts.request.text_segmenter import split_text

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
                                         ("--kv-cache-gb", "-1"), ("--max-waiting", "0"), ("--port", "99999")])
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


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the model starts loading: what can be checked without it must be refused first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("q3tts.cli.commands._load", refuse)


@pytest.fixture
def truncated_checkpoint(tmp_path) -> Path:
    import shutil

    from q3tts.tiny import tiny_checkpoint

    folder = shutil.copytree(tiny_checkpoint("tiny"), tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


@pytest.mark.parametrize("args, message", [
    (["/nonexistent"], "/nonexistent: no such checkpoint folder"),
    (["tiny", "--dtype", "int8"], "--dtype torch.int8 is not supported"),
    (["tiny", "--dtype", "fp16"], "unknown --dtype 'fp16': use float32, bfloat16 or float16"),
    (["tiny", "--device", "mps"], "--device 'mps' is not supported"),
    (["tiny", "--lora", "/nonexistent"], "--lora /nonexistent: no such adapter folder; a LoRA adapter is a folder"),
    (["TRUNCATED"], "model.safetensors: not a readable safetensors file"),
], ids=["no-folder", "int8", "fp16", "mps", "lora", "truncated"])
def test_serve_refuses_an_engine_that_cannot_start_in_one_line(args, message, truncated_checkpoint, capsys,
                                                              monkeypatch):
    """(These once started the server, whose lifespan failed with uvicorn's traceback and exit 3.)"""
    import q3tts.server

    def refuse(*args, **kwargs):
        raise AssertionError("the server was started")

    monkeypatch.setattr(q3tts.server, "serve", refuse)
    args = [str(truncated_checkpoint) if a == "TRUNCATED" else a for a in args]
    assert main(["serve", *args, "--port", "18765"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("q3tts: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb must be > 0"),
    (["--max-context", "5"], "--max-context must be an integer >= 64"),
    (["--temperature", "0"], "--temperature must be a finite number > 0"),
    (["--seed", "-1"], "--seed must be a non-negative integer"),
    (["--device", "mps"], "--device 'mps' is not supported"),
    (["--device", "meta"], "--device 'meta' is not supported"),
    (["--device", "gpu"], "unknown --device 'gpu': use cpu, cuda or cuda:N"),
    (["--ref-audio", "me.wav"], "--ref-audio: voice cloning needs a Base checkpoint; this one is custom_voice"),
    (["--ref-text", "Hi.", "--x-vector-only"], "--ref-text and --x-vector-only: voice cloning needs a Base"),
    (["--model", "tiny-voice-design", "--instruct", "Calm.", "--x-vector-only"],
     "--x-vector-only: voice cloning needs a Base checkpoint; this one is voice_design"),
    (["--model", "tiny-base", "--voice", "me.voice", "--ref-audio", "me.wav"],
     "--voice is a voice already cloned: give it or --ref-audio, not both"),
    (["--model", "tiny-base", "--voice", "nowhere.voice"], "nowhere.voice: voice file not found"),
    (["--model", "tiny-base", "--ref-audio", "nowhere.wav", "--ref-text", "Hi."], "--ref-audio nowhere.wav: no such "
                                                                                  "file"),
    (["--model", "tiny-base", "--ref-audio", "REF"], "--ref-text (the reference's transcript) is needed"),
    (["--model", "tiny-base", "--ref-audio", "REF", "--ref-text", "Hi.", "--speaker", "ryan"],
     "--speaker needs a CustomVoice checkpoint (this one is base)"),
    (["--model", "tiny-voice-design"], "this VoiceDesign checkpoint needs --instruct"),
    (["--language", "klingon"], "unsupported language 'klingon'"),
    (["--lora", "./no-adapter"], "--lora ./no-adapter: no such adapter folder"),
    (["--model", "tiny-custom-voice-0.6b", "--instruct", "Whisper."], "this 0.6B CustomVoice checkpoint does not "
                                                                       "follow --instruct"),
], ids=["max-new-tokens", "kv-cache", "max-context", "temperature", "seed", "mps", "meta", "gpu", "ref-audio-on-custom",
        "ref-text-on-custom", "x-vector-on-design", "voice-and-ref-audio", "voice-missing", "ref-audio-missing",
        "ref-text-missing", "speaker-on-base", "design-without-instruct", "language", "lora", "instruct-on-0.6b"])
def test_say_refuses_before_loading_the_model(args, message, tmp_path, capsys, no_model_load):
    """Flags that cannot work are refused in one line naming the flag, before the model loads (once some were
    refused only after "loading ...", some were silently ignored, and --max-new-tokens 1 wrote an empty file)."""
    out = tmp_path / "out.wav"
    sf.write(tmp_path / "ref.wav", speech_like(1.0, 16000, 9), 16000)
    args = [str(tmp_path / "ref.wav") if a == "REF" else a for a in args]
    argv = ["say", "Hello.", "--model", "tiny", "--max-new-tokens", "3", "-o", str(out), *args]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"q3tts: error: {message}") and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux): a folder no file can be made in")
def test_an_unwritable_output_is_refused_before_any_work(capsys, no_model_load):
    """(`say -o /proc/x.wav` once generated all the audio, then ended in a LibsndfileError traceback; `voice
    create` in a SafetensorError one.)"""
    assert main(["say", "Hello.", "--model", "tiny", "--max-new-tokens", "3", "-o", "/proc/x.wav"]) == 1
    assert capsys.readouterr().err == "q3tts: error: -o /proc/x.wav: cannot write there (No such file or directory)\n"
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", "me.wav", "-o", "/proc/x.voice"]) == 1
    assert "-o /proc/x.voice: cannot write there" in capsys.readouterr().err


def test_a_failed_write_is_one_line_naming_the_output(tmp_path, capsys, monkeypatch):
    """A write that fails after the checks (a full disk ...) is one line naming -o, not libsndfile's traceback; the
    check leaves no file behind when the run fails, and a file already there untouched."""
    out = tmp_path / "out.wav"
    assert main(["say", "Hello.", "--model", "tiny", "--speaker", "nobody", "-o", str(out)]) == 1
    assert not out.exists()
    out.write_bytes(b"before")
    assert main(["say", "Hello.", "--model", "tiny", "--speaker", "nobody", "-o", str(out)]) == 1
    assert out.read_bytes() == b"before"
    capsys.readouterr()

    def full_disk(*args, **kwargs):
        raise sf.LibsndfileError(9, "Error opening file: ")

    monkeypatch.setattr(sf, "write", full_disk)
    assert main(["say", "Hello.", "--model", "tiny", "--max-new-tokens", "3", "-o", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"q3tts: error: -o {out}: could not write the audio"), err


@pytest.mark.parametrize("command", ["voice", "bench"])
def test_a_command_without_its_subcommand_prints_its_own_help(command, capsys):
    assert main([command]) == 2
    assert capsys.readouterr().out.startswith(f"usage: q3tts {command} ")


def test_a_reference_file_name_keeps_its_spelling_in_errors(tmp_path, capsys):
    """Argument names in messages become flags, but not inside a path: a reference audio that cannot be read is
    named as it was given, after the flag (`say` and `voice create` once named the file alone)."""
    bad = tmp_path / "ref_audio.wav"
    bad.write_bytes(b"not audio")
    assert main(["say", "Hello.", "--model", "tiny-base", "--ref-audio", str(bad), "--x-vector-only",
                 "--max-new-tokens", "3", "-o", str(tmp_path / "out.wav")]) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"q3tts: error: --ref-audio {bad}: not a readable audio file")
    sf.write(tmp_path / "silent.wav", np.zeros(16000, dtype=np.float32), 16000)
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", str(tmp_path / "silent.wav"),
                 "--x-vector-only", "-o", str(tmp_path / "me.voice")]) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"q3tts: error: --ref-audio {tmp_path / 'silent.wav'}: "), error


def test_serve_exits_1_in_one_line_when_the_model_does_not_load(tmp_path):
    """Whole files whose weights do not load (a tensor missing) pass the command's own checks; the server then
    says why in one line and exits 1 (it was uvicorn's start-up traceback and exit 3)."""
    import shutil
    import socket

    from safetensors.torch import load_file, save_file

    from q3tts.tiny import tiny_checkpoint

    folder = Path(shutil.copytree(tiny_checkpoint("tiny", tmp_path / "cache"), tmp_path / "ckpt"))
    tensors = load_file(folder / "model.safetensors")
    del tensors["talker.codec_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "q3tts.cli", "serve", str(folder), "--port", str(port)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the model did not load" in done.stderr and "talker.codec_head.weight" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_an_empty_speaker_is_not_replaced_and_gpu_benchmarks_say_they_need_one(tmp_path, capsys, monkeypatch):
    """`--speaker ""` is refused as the API refuses it (it once became the default speaker, silently); `q3tts bench
    decode` / `streaming` / `api` without a GPU say so in one line (once a traceback from deep inside torch; `api`
    once said to use a device it has no option for)."""
    out = tmp_path / "out.wav"
    assert main(["say", "Hi.", "--model", "tiny", "--speaker", "", "--max-new-tokens", "3", "-o", str(out)]) == 1
    assert "needs --speaker" in capsys.readouterr().err and not out.exists()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in ("decode", "streaming", "api"):
        assert main(["bench", command, *(["--ckpt-root", str(tmp_path)] if command == "api" else [])]) == 1
        err = capsys.readouterr().err
        assert err == f"q3tts: error: q3tts bench {command} needs a CUDA GPU and none is visible here " \
                      f"(torch {torch.__version__})\n", err


def test_say_writes_a_wav_to_standard_output_and_reads_its_text_file_from_standard_input(tmp_path):
    """`say -f - -o -`: a pipe in, a WAV file out (the messages on standard error)."""
    done = subprocess.run([sys.executable, "-m", "q3tts.cli", "say", "-f", "-", "-o", "-", "--model", "tiny",
                           "--max-new-tokens", "3", "--seed", "1"], input=b"From a pipe.", capture_output=True,
                          env={**os.environ, "Q3TTS_CACHE": str(tmp_path / "cache")}, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    import io

    wav, sr = sf.read(io.BytesIO(done.stdout), dtype="int16")
    assert sr == 24000 and len(wav) == 2 * 1920
    assert b"wrote standard output" in done.stderr


def test_x_vector_only_with_a_transcript_warns_that_it_is_unused(tmp_path, capsys):
    ref = tmp_path / "ref.wav"
    sf.write(ref, speech_like(1.0, 16000, 9), 16000)
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", str(ref), "--ref-text", "Hi.",
                 "--x-vector-only", "-o", str(tmp_path / "x.voice")]) == 0
    assert "q3tts: warning: --ref-text is not used with --x-vector-only" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc (Linux): a folder no folder can be made in")
def test_serve_refuses_an_unusable_voices_dir_in_one_line(tmp_path, capsys, no_model_load):
    """(It once loaded the model, then ended in uvicorn's start-up traceback with exit 3.)"""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for folder in ("/proc/nope", str(afile)):
        assert main(["serve", "tiny", "--device", "cpu", "--voices-dir", folder]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"q3tts: error: --voices-dir {folder!r} cannot be a folder of voices") and \
            err.count("\n") == 1, err
    damaged = tmp_path / "voices"
    damaged.mkdir()
    (damaged / "index.json").write_text("")  # (once: the model loaded, then uvicorn's traceback and exit 3)
    assert main(["serve", "tiny", "--device", "cpu", "--voices-dir", str(damaged)]) == 1
    err = capsys.readouterr().err
    assert "index.json: not a readable voice index" in err and err.count("\n") == 1, err


def test_a_voice_of_another_model_names_the_flag_and_its_file(tmp_path, capsys, no_model_load):
    """(It said "this voice was made for a 1.7B model ..." naming neither --voice nor the file.)"""
    import torch

    from q3tts import Voice

    Voice.from_embedding(torch.randn(96), "1b7").save(tmp_path / "big.voice")
    assert main(["say", "Hello.", "--model", "tiny-base", "--voice", str(tmp_path / "big.voice"),
                 "--max-new-tokens", "3", "-o", str(tmp_path / "out.wav")]) == 1
    assert capsys.readouterr().err.startswith(f"q3tts: error: --voice {tmp_path / 'big.voice'}: this voice was made "
                                              "for a 1.7B model")

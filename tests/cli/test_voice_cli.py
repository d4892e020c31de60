"""`q3tts voice create --embedding`, `voice blend` and `say --script` (dialogues) on the built-in tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from q3tts import Voice
from q3tts.cli import main


@pytest.fixture(autouse=True)
def tiny_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("Q3TTS_CACHE", str(tmp_path_factory.getbasetemp() / "q3tts-cli-cache"))


def test_voice_create_from_a_speaker_pt_then_say(tmp_path, capsys):
    """faster-qwen3-tts's speaker.pt (a torch.save'd bf16 tensor) and raw float32 become voice files."""
    embedding = torch.randn(64)
    torch.save(embedding.to(torch.bfloat16), tmp_path / "speaker.pt")
    (tmp_path / "speaker.f32").write_bytes(embedding.numpy().astype("<f4").tobytes())
    for name in ("speaker.pt", "speaker.f32"):
        out = tmp_path / f"{name}.voice"
        assert main(["voice", "create", "--model", "tiny-base", "--embedding", str(tmp_path / name),
                     "-o", str(out)]) == 0
        assert "x-vector only, 0.6B" in capsys.readouterr().err
        voice = Voice.load(out)
        assert voice.x_vector_only_mode and voice.model_size == "0b6"
    assert torch.equal(Voice.load(tmp_path / "speaker.f32.voice").ref_spk_embedding, embedding)
    wav = tmp_path / "out.wav"
    assert main(["say", "Hi.", "--model", "tiny-base", "--voice", str(tmp_path / "speaker.pt.voice"), "-o", str(wav),
                 "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert sf.info(wav).frames == 3 * 1920


@pytest.mark.parametrize("model, flags, says", [
    ("tiny-base", ["--embedding", "{wrong}"], "96 values; the speaker embeddings of this 0.6B checkpoint have 64"),
    ("tiny-base", ["--embedding", "{nan}"], "NaN or infinite"),
    ("tiny-base", ["--embedding", "{missing}"], "embedding file not found"),
    ("tiny-base", ["--embedding", "{nan}", "--ref-audio", "x.wav"], "one of them"),
    ("tiny-base", ["--embedding", "{wrong}", "--x-vector-only"], "go with --ref-audio"),
    ("tiny", ["--embedding", "{wrong}"], "needs a Base checkpoint"),
])
def test_voice_create_embedding_refusals(tmp_path, capsys, model, flags, says):
    torch.save(torch.zeros(96), tmp_path / "wrong.pt")
    torch.save(torch.full((64,), float("inf")), tmp_path / "nan.pt")
    paths = {"wrong": tmp_path / "wrong.pt", "nan": tmp_path / "nan.pt", "missing": tmp_path / "missing.pt"}
    flags = [flag.format(**paths) for flag in flags]
    assert main(["voice", "create", "--model", model, *flags, "-o", str(tmp_path / "v.voice")]) == 1
    assert says in capsys.readouterr().err
    assert not (tmp_path / "v.voice").exists()


def test_voice_blend_writes_the_weighted_mean(tmp_path, capsys):
    a, b = torch.randn(64), torch.randn(64)
    for name, embedding in (("a", a), ("b", b)):
        torch.save(embedding, tmp_path / f"{name}.pt")
        assert main(["voice", "create", "--model", "tiny-base", "--embedding", str(tmp_path / f"{name}.pt"),
                     "-o", str(tmp_path / f"{name}.voice")]) == 0
    out = tmp_path / "mix.voice"
    assert main(["voice", "blend", str(tmp_path / "a.voice"), str(tmp_path / "b.voice"), "--weights", "3", "1",
                 "-o", str(out)]) == 0
    assert "a.voice 0.75, b.voice 0.25" in capsys.readouterr().err
    mixed = Voice.load(out)
    assert torch.equal(mixed.ref_spk_embedding, ((3 * a.double() + b.double()) / 4).float())
    assert mixed.x_vector_only_mode and mixed.model_size == "0b6"
    wav = tmp_path / "mix.wav"
    assert main(["say", "Hi.", "--model", "tiny-base", "--voice", str(out), "-o", str(wav), "--max-new-tokens", "3",
                 "--seed", "1"]) == 0


def test_voice_blend_refusals(tmp_path, capsys):
    torch.save(torch.randn(64), tmp_path / "a.pt")
    assert main(["voice", "create", "--model", "tiny-base", "--embedding", str(tmp_path / "a.pt"),
                 "-o", str(tmp_path / "a.voice")]) == 0
    ref = tmp_path / "ref.wav"
    sf.write(ref, np.sin(np.arange(24000) / 10).astype(np.float32) * 0.3, 24000)
    assert main(["voice", "create", "--model", "tiny-base", "--ref-audio", str(ref), "--ref-text", "Hello.",
                 "-o", str(tmp_path / "icl.voice")]) == 0
    capsys.readouterr()
    a, icl = str(tmp_path / "a.voice"), str(tmp_path / "icl.voice")
    for flags, says in (([a, icl], "is an in-context voice: its reference recording's codes and transcript cannot "
                                   "be mixed"),
                        ([a, a, "--weights", "1"], "--weights: 1 weights for 2 voices"),
                        ([a, a, "--weights", "1", "-2"], "--weights: the weight of"),
                        ([a, str(tmp_path / "none.voice")], "voice file not found")):
        assert main(["voice", "blend", *flags, "-o", str(tmp_path / "mix.voice")]) == 1
        assert says in capsys.readouterr().err
    assert not (tmp_path / "mix.voice").exists()


def test_say_script_json_lines_and_voice_tags(tmp_path, capsys):
    script = tmp_path / "talk.jsonl"
    script.write_text('{"speaker": "ryan", "text": "Hello.", "pause": 0.5}\n{"speaker": "vivian", "text": "Hi."}\n')
    out = tmp_path / "talk.wav"
    assert main(["say", "--script", str(script), "--model", "tiny", "-o", str(out), "--max-new-tokens", "4",
                 "--seed", "1"]) == 0
    assert sf.info(out).frames == 2 * 3 * 1920 + 12000 and "2 turns" in capsys.readouterr().err
    torch.save(torch.randn(64), tmp_path / "a.pt")
    assert main(["voice", "create", "--model", "tiny-base", "--embedding", str(tmp_path / "a.pt"),
                 "-o", str(tmp_path / "amy.voice")]) == 0
    tagged = tmp_path / "talk.txt"
    tagged.write_text("[voice:amy] Hello there. [voice:amy.voice] And again.")
    assert main(["say", "--script", str(tagged), "--model", "tiny-base", "-o", str(out), "--max-new-tokens", "4",
                 "--seed", "1"]) == 0
    assert sf.info(out).frames == 2 * 3 * 1920


def test_say_script_refusals_name_the_turn(tmp_path, capsys):
    script = tmp_path / "talk.jsonl"
    script.write_text('{"speaker": "ryan", "text": "Hello."}\n{"speaker": "nobody", "text": "Hi."}\n')
    out = tmp_path / "talk.wav"
    assert main(["say", "--script", str(script), "--model", "tiny", "-o", str(out)]) == 1
    assert "turn 1: unknown speaker 'nobody'" in capsys.readouterr().err
    assert main(["say", "Hi.", "--script", str(script), "--model", "tiny", "-o", str(out)]) == 1
    assert "give no text" in capsys.readouterr().err
    assert main(["say", "--script", str(tmp_path / "none.jsonl"), "--model", "tiny", "-o", str(out)]) == 1
    assert "none.jsonl" in capsys.readouterr().err
    assert not out.exists()


def test_say_script_checks_its_output_first_and_keeps_the_flags_say_takes(tmp_path, capsysbinary, monkeypatch):
    """(`say --script` once generated every turn before refusing `-o talk.xyz` in libsndfile's words, wrote no
    standard output for `-o -`, and dropped --play and --non-streaming-text without a word.)"""
    import io

    from q3tts.api.tts import TTS

    script = tmp_path / "talk.jsonl"
    script.write_text('{"speaker": "ryan", "text": "Hello."}\n{"speaker": "vivian", "text": "Hi."}\n')
    (tmp_path / "latin1.txt").write_bytes("[voice:amy] Caf\xe9.".encode("latin-1"))
    run = ["say", "--model", "tiny", "--max-new-tokens", "3", "--seed", "1", "--script"]
    with monkeypatch.context() as patch:
        patch.setattr("q3tts.cli.commands._load", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main([*run, str(script), "-o", str(tmp_path / "talk.xyz")]) == 1
        assert f"-o {tmp_path / 'talk.xyz'}: the file's extension names no audio format" in \
            capsysbinary.readouterr().err.decode()
        assert main([*run, str(tmp_path / "latin1.txt"), "-o", str(tmp_path / "talk.wav")]) == 1
        assert capsysbinary.readouterr().err.decode().startswith(
            f"q3tts: error: --script {tmp_path / 'latin1.txt'}: not UTF-8")
    given = {}
    stream_dialogue = TTS.stream_dialogue
    monkeypatch.setattr(TTS, "stream_dialogue", lambda self, turns, **defaults: (
        given.update(defaults), stream_dialogue(self, turns, **defaults))[1])
    assert main([*run, str(script), "-o", "-", "--non-streaming-text", "--play"]) == 0
    captured = capsysbinary.readouterr()
    wav, sr = sf.read(io.BytesIO(captured.out), dtype="int16")
    assert sr == 24000 and len(wav) == 2 * 2 * 1920 and given["non_streaming_mode"] is True
    assert b"cannot play" in captured.err and b"wrote standard output: 2 turns" in captured.err


def test_voice_commands_refuse_an_audio_name_for_the_voice_file(tmp_path, capsys):
    """(`voice create -o me.wav` wrote a voice file, which no player reads, under an audio file's name.)"""
    torch.save(torch.randn(64), tmp_path / "a.pt")
    for command in (["create", "--model", "tiny-base", "--embedding", str(tmp_path / "a.pt")],
                    ["blend", str(tmp_path / "a.voice")]):
        assert main(["voice", *command, "-o", str(tmp_path / "me.wav")]) == 1
        assert f"-o {tmp_path / 'me.wav'}: a voice file is not audio" in capsys.readouterr().err
        assert not (tmp_path / "me.wav").exists()

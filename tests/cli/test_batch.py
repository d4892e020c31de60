"""`q3tts batch`: many requests from a JSON-lines file, bad lines reported, resumable, with a manifest."""

from __future__ import annotations

import json

import pytest
import soundfile as sf

from q3tts.cli import main

JOBS = [
    {"text": "Hello there.", "speaker": "ryan", "seed": 1, "max_new_tokens": 5},
    {"text": "Second line.", "speaker": "eric", "id": "second", "max_new_tokens": 4},
    "not json",
    {"text": "", "speaker": "ryan"},
    {"text": "Bad speaker.", "speaker": "nobody"},
    {"text": "Twice.", "speaker": "ryan", "id": "second"},
    {"text": "Third.", "speaker": "serena", "max_new_tokens": 6, "temperature": 0.5},
    {"text": "Named as line 9 is.", "speaker": "ryan", "id": "000009", "max_new_tokens": 3},
    {"text": "Line 9, no id.", "speaker": "ryan"},
]


def test_batch_renders_resumes_and_reports(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("Q3TTS_CACHE", str(tmp_path / "cache"))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(j if isinstance(j, str) else json.dumps(j) for j in JOBS) + "\n\n")
    out = tmp_path / "out"
    assert main(["batch", str(jobs), "--out-dir", str(out), "--model", "tiny", "--max-rows", "2"]) == 1  # bad lines
    err = capsys.readouterr().err
    reported = ((3, "not JSON"), (4, "text is empty"), (5, "unknown speaker"), (6, "id 'second' is used by"),
                (9, "id '000009' (the default: the line number) is used by an earlier line: give this line an `id`"))
    for line, words in reported:
        assert f"line {line}: {words}" in err
    assert "4 rendered, 0 already there, 5 bad lines" in err
    frames = {"000001.wav": 4, "second.wav": 3, "000007.wav": 5, "000009.wav": 2}
    assert sorted(p.name for p in out.glob("*.wav")) == sorted(frames)
    for name, n in frames.items():
        assert sf.info(out / name).frames == n * 1920
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [m["line"] for m in manifest] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [m.get("status") for m in manifest] == ["rendered", "rendered", None, None, None, None, "rendered",
                                                   "rendered", None]
    (out / "second.wav").unlink()
    assert main(["batch", str(jobs), "--out-dir", str(out), "--model", "tiny"]) == 1
    assert "1 rendered, 3 already there, 5 bad lines" in capsys.readouterr().err
    assert sf.info(out / "second.wav").frames == 3 * 1920
    manifest = {m["line"]: m for m in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    assert manifest[1]["status"] == "skipped (already rendered)" and manifest[1]["seconds"] == 4 * 0.08
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(JOBS[0]) + "\n")
    assert main(["batch", str(good), "--out-dir", str(tmp_path / "good"), "--model", "tiny"]) == 0


def test_a_jobs_file_not_utf8_and_an_out_dir_that_is_a_file_are_refused_first(tmp_path, capsys, monkeypatch):
    """(Both were refused after the model had loaded, in Python's words: "'utf-8' codec can't decode byte ...",
    "[Errno 17] File exists: ...", naming neither the jobs file nor --out-dir.)"""
    monkeypatch.setattr("q3tts.cli.commands._load", lambda *a, **k: pytest.fail("the model was loaded"))
    jobs, latin1 = tmp_path / "jobs.jsonl", tmp_path / "latin1.jsonl"
    jobs.write_text(json.dumps({"text": "Hi.", "speaker": "ryan"}) + "\n")
    latin1.write_bytes(json.dumps({"text": "Caf\xe9.", "speaker": "ryan"}, ensure_ascii=False).encode("latin-1"))
    assert main(["batch", str(latin1), "--out-dir", str(tmp_path / "out"), "--model", "tiny"]) == 1
    assert capsys.readouterr().err.startswith(f"q3tts: error: {latin1}: not UTF-8 text")
    assert main(["batch", str(jobs), "--out-dir", str(jobs), "--model", "tiny"]) == 1
    assert capsys.readouterr().err == f"q3tts: error: --out-dir {jobs}: that is a file; give a folder (made if " \
        "missing)\n"


def test_an_unknown_field_is_named_with_what_a_line_takes(tmp_path):
    """(`ref_audio` was "unexpected generation arguments" listing the sampling fields alone, as if a line took no
    speaker or voice; a voice file's hint pointed at ref_audio, which a line does not take.)"""
    from q3tts.cli.batch import read_items

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"text": "Hi.", "ref_audio": "me.wav"}) + "\n"
                    + json.dumps({"text": "Hi.", "speeker": "ryan"}) + "\n")
    items, errors = read_items(None, jobs)  # (refused before the model is asked anything)
    assert not items and [e["line"] for e in errors] == [1, 2]
    assert "a line clones no recording; make a voice file with `q3tts voice create`" in errors[0]["error"]
    assert errors[1]["error"].startswith("unknown field 'speeker' (did you mean `speaker`?); a line takes id, "
                                         "instruct, language, non_streaming_mode, seed, speaker, text, voice and the "
                                         "sampling fields do_sample, "), errors[1]


def test_ids_that_differ_only_in_case_are_refused(tmp_path):
    """(`upper` and `Upper` name one file on macOS and Windows: the second line was skipped as already rendered, or
    overwrote the first's audio.)"""
    from types import SimpleNamespace

    from q3tts.cli.batch import read_items

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"text": "Hi.", "id": name}) + "\n" for name in ("upper", "Upper", "other")))
    items, errors = read_items(SimpleNamespace(pieces=lambda text, **kwargs: []), jobs)
    assert [item.id for item in items] == ["upper", "other"]
    assert errors == [{"line": 2, "error": "id 'Upper' is used by an earlier line as 'upper' (one file on macOS and "
                                           "Windows)"}]


def test_a_byte_order_mark_is_not_text(tmp_path, monkeypatch):
    """A UTF-8 BOM (Notepad writes one) before a jobs file, a script or a `say -f` text: line 1 was "not JSON
    (Unexpected UTF-8 BOM)", a script's first turn refused, a text spoken with U+FEFF at its start."""
    from types import SimpleNamespace

    from q3tts.cli.batch import read_items
    from q3tts.request.dialogue import read_script

    jobs, script, text = tmp_path / "jobs.jsonl", tmp_path / "talk.jsonl", tmp_path / "text.txt"
    jobs.write_text(json.dumps({"text": "Hi.", "speaker": "ryan"}) + "\n", encoding="utf-8-sig")
    script.write_text(json.dumps({"text": "Hi.", "speaker": "ryan"}) + "\n", encoding="utf-8-sig")
    text.write_text("Hello.", encoding="utf-8-sig")
    items, errors = read_items(SimpleNamespace(pieces=lambda text, **kwargs: []), jobs)
    assert len(items) == 1 and not errors
    assert [turn.text for turn in read_script(script, "custom_voice")] == ["Hi."]
    spoken = []

    def check_text(value):
        spoken.append(value)
        raise ValueError("stop here")

    monkeypatch.setattr("q3tts.request.builder.check_text", check_text)
    assert main(["say", "-f", str(text), "--model", "tiny", "-o", str(tmp_path / "out.wav")]) == 1
    assert spoken == ["Hello."]

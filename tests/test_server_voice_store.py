"""The server's store of uploaded voices: persistence under a folder, lookup by id or name, deletion."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")

from q3tts.server.voice_store import VoiceStore  # noqa: E402
from q3tts.voice import Voice  # noqa: E402


def _voice(icl: bool) -> Voice:
    return Voice(ref_code=torch.randint(0, 2048, (5, 16)) if icl else None, ref_spk_embedding=torch.randn(64),
                 x_vector_only_mode=not icl, icl_mode=icl, ref_text="hello" if icl else None, model_size="0b6")


def test_voices_persist_and_reload(tmp_path):
    store = VoiceStore(tmp_path)
    a = store.add(_voice(True), name="alice")
    b = store.add(_voice(False))
    assert (tmp_path / f"{a.id}.safetensors").exists()
    assert set(json.loads((tmp_path / "index.json").read_text())) == {a.id, b.id}
    reloaded = VoiceStore(tmp_path)
    entry, voice = reloaded.get("alice")
    assert entry.id == a.id and voice.icl_mode and voice.ref_text == "hello" and voice.ref_code.shape == (5, 16)
    assert [e.id for e in reloaded.list()] == [e.id for e in store.list()]


def test_names_are_unique_and_delete_removes_the_file(tmp_path):
    store = VoiceStore(tmp_path)
    entry = store.add(_voice(False), name="bob")
    with pytest.raises(ValueError, match="already exists"):
        store.add(_voice(False), name="bob")
    assert store.delete(entry.id).id == entry.id
    assert store.get(entry.id) is None and store.delete(entry.id) is None
    assert not (tmp_path / f"{entry.id}.safetensors").exists()


def test_memory_only_store():
    store = VoiceStore(None)
    entry = store.add(_voice(True))
    assert store.get(entry.id)[1].icl_mode and store.list() == [entry]

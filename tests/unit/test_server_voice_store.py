"""The server's store of uploaded voices: persistence under a folder, lookup by id or name, deletion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from q3tts.request.voice import Voice  # noqa: E402
from q3tts.server.voice_store import VoiceStore  # noqa: E402


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


def _add_many(folder: str, count: int, go) -> None:  # (in another process: another server on the same folder)
    store = VoiceStore(Path(folder))
    go.wait()
    for _ in range(count):
        store.add(_voice(False))


def test_servers_sharing_a_folder_lose_no_upload(tmp_path):
    """Processes adding voices to one folder at once: every voice in the index (each change under the folder's
    lock; the index once kept the last writer's view only, and uploads answered 201 vanished)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    go = context.Barrier(3)  # (all three add at once, once started)
    workers = [context.Process(target=_add_many, args=(str(tmp_path), 20, go)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    store = VoiceStore(tmp_path)
    assert len(store.list()) == 60 == len(list(tmp_path.glob("*.safetensors")))


def test_a_damaged_index_or_voice_file(tmp_path, caplog):
    """At start a damaged index is refused naming it; while running the voices read before stay in use and the
    next change writes the index again; a damaged voice file is a VoiceStoreError, not a traceback."""
    from q3tts.server.voice_store import VoiceStoreError

    store = VoiceStore(tmp_path)
    kept = store.add(_voice(False), name="kept")
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(VoiceStoreError, match=r"index\.json: not a readable voice index"):
        VoiceStore(tmp_path)
    assert store.get("kept")[0].id == kept.id and [e.id for e in store.list()] == [kept.id]
    assert "not a readable voice index" in caplog.text
    added = store.add(_voice(False))
    assert {e.id for e in VoiceStore(tmp_path).list()} == {kept.id, added.id}
    (tmp_path / f"{added.id}.safetensors").write_bytes(b"damaged")
    with pytest.raises(VoiceStoreError, match="cannot be read on this server"):
        VoiceStore(tmp_path).get(added.id)

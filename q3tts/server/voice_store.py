"""Uploaded (cloned) voices: `Voice` files under one folder plus a small JSON index, or memory only.

Layout: `<folder>/<id>.safetensors` (Voice.save) and `<folder>/index.json` ({id: metadata}). The index is
rewritten atomically; loaded voices are cached. Thread-safe (voices are created in worker threads). Several
servers may share a folder (`q3tts serve --devices`): each re-reads the index when another has rewritten it.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import quote
from ..voice import Voice

INDEX = "index.json"


@dataclass
class StoredVoice:
    id: str
    name: str
    created_at: int
    x_vector_only_mode: bool
    ref_text: str | None
    model_size: str | None

    def to_json(self) -> dict:
        return {"object": "voice", "type": "cloned", **asdict(self)}


class VoiceStore:
    def __init__(self, folder: Path | None = None):
        self.folder = folder
        self._lock = threading.Lock()
        self._entries: dict[str, StoredVoice] = {}
        self._voices: dict[str, Voice] = {}
        self._index_stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the index last read or written
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._sync()

    def add(self, voice: Voice, name: str | None = None) -> StoredVoice:
        """Stores `voice` under a new id; names must be unique (ValueError otherwise)."""
        voice_id = f"voice_{secrets.token_hex(8)}"
        entry = StoredVoice(id=voice_id, name=name or voice_id, created_at=int(time.time()),
                            x_vector_only_mode=voice.x_vector_only_mode, ref_text=voice.ref_text,
                            model_size=voice.model_size)
        with self._lock:
            self._sync()
            if name and self._find(name) is not None:
                raise ValueError(f"a voice named {quote(name)} already exists")
            if self.folder is not None:
                voice.save(self.folder / f"{voice_id}.safetensors")
            self._entries[voice_id] = entry
            self._voices[voice_id] = voice
            self._write_index()
        return entry

    def get(self, key: str) -> tuple[StoredVoice, Voice] | None:
        """The voice with this id (or, failing that, this name)."""
        with self._lock:
            self._sync()
            entry = self._find(key)
            if entry is None:
                return None
            if entry.id not in self._voices:
                self._voices[entry.id] = Voice.load(self.folder / f"{entry.id}.safetensors")
            return entry, self._voices[entry.id]

    def delete(self, key: str) -> StoredVoice | None:
        with self._lock:
            self._sync()
            entry = self._find(key)
            if entry is None:
                return None
            del self._entries[entry.id]
            self._voices.pop(entry.id, None)
            if self.folder is not None:
                (self.folder / f"{entry.id}.safetensors").unlink(missing_ok=True)
            self._write_index()
            return entry

    def list(self) -> list[StoredVoice]:
        with self._lock:
            self._sync()
            return sorted(self._entries.values(), key=lambda e: (e.created_at, e.id))

    def _find(self, key: str) -> StoredVoice | None:
        if key in self._entries:
            return self._entries[key]
        return next((e for e in self._entries.values() if e.name == key), None)

    def _sync(self) -> None:
        """Re-reads the index if it changed on disk since this store last read or wrote it."""
        if self.folder is None:
            return
        try:
            stat = (self.folder / INDEX).stat()
        except FileNotFoundError:
            return
        if (stat.st_mtime_ns, stat.st_size) != self._index_stamp:
            self._entries = {k: StoredVoice(**v) for k, v in json.loads((self.folder / INDEX).read_text()).items()}
            self._voices = {k: v for k, v in self._voices.items() if k in self._entries}
            self._index_stamp = (stat.st_mtime_ns, stat.st_size)

    def _write_index(self) -> None:
        if self.folder is None:
            return
        tmp = self.folder / f".{INDEX}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({k: asdict(v) for k, v in self._entries.items()}, indent=1))
        os.replace(tmp, self.folder / INDEX)
        stat = (self.folder / INDEX).stat()
        self._index_stamp = (stat.st_mtime_ns, stat.st_size)

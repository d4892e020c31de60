"""Uploaded (cloned) voices: `Voice` files under one folder plus a small JSON index, or memory only.

Layout: `<folder>/<id>.safetensors` (Voice.save) and `<folder>/index.json` ({id: metadata}). The index is
rewritten atomically (a new file, synced, renamed); loaded voices are cached. Thread-safe (voices are created in
worker threads). Several servers may share a folder (`q3tts serve --devices`, Ray Serve replicas): each re-reads
the index when another has rewritten it, and each change is made under an exclusive lock on `<folder>/.lock`
(flock), so two servers' uploads never overwrite each other's. A damaged index stops a server from starting (one
line naming it); one damaged while running is reported once and the voices read before stay in use (the next
change writes the index again from them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import RequestError, quote
from ..request.voice import Voice

try:
    import fcntl
except ImportError:  # (not POSIX: one server per folder)
    fcntl = None

log = logging.getLogger("q3tts.server")
INDEX = "index.json"
LOCK = ".lock"


class VoiceStoreError(ValueError):
    """The voices folder's index, or a voice file in it, cannot be read."""


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
        self._started = False
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self._sync()
        self._started = True

    def add(self, voice: Voice, name: str | None = None) -> StoredVoice:
        """Stores `voice` under a new id; names must be unique (ValueError otherwise)."""
        voice_id = f"voice_{secrets.token_hex(8)}"
        entry = StoredVoice(id=voice_id, name=name or voice_id, created_at=int(time.time()),
                            x_vector_only_mode=voice.x_vector_only_mode, ref_text=voice.ref_text,
                            model_size=voice.model_size)
        with self._changing():
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
                path = self.folder / f"{entry.id}.safetensors"
                try:
                    self._voices[entry.id] = Voice.load(path)
                except (RequestError, OSError, ValueError) as e:
                    log.error("the stored voice %s cannot be read: %s: %s", entry.id, path, e)
                    raise VoiceStoreError(f"the stored voice {quote(key)} cannot be read on this server (its log "
                                          "says why)") from None
            return entry, self._voices[entry.id]

    def delete(self, key: str) -> StoredVoice | None:
        with self._changing():
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

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """The store locked for a change: this process's threads and (flock) every other server on the folder;
        the index read afresh inside (another may have changed it within the same stamp)."""
        with self._lock:
            if self.folder is None or fcntl is None:
                self._sync(force=True)
                yield
                return
            with open(self.folder / LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
                self._sync(force=True)
                yield

    def _sync(self, force: bool = False) -> None:
        """Re-reads the index if it changed on disk since this store last read or wrote it."""
        if self.folder is None:
            return
        path = self.folder / INDEX
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._index_stamp and not force:
            return
        try:
            entries = {k: StoredVoice(**v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}
        except (ValueError, TypeError, AttributeError, OSError) as e:
            if not self._started:  # (nothing read before to go on with)
                raise VoiceStoreError(f"{path}: not a readable voice index ({e}); restore it, or move it away to "
                                      f"start with no stored voices") from None
            if stamp != self._index_stamp:
                log.error("%s: not a readable voice index (%s); the %d voices read before stay in use", path, e,
                          len(self._entries))
                self._index_stamp = stamp
            return
        self._entries = entries
        self._voices = {k: v for k, v in self._voices.items() if k in self._entries}
        self._index_stamp = stamp

    def _write_index(self) -> None:
        if self.folder is None:
            return
        tmp = self.folder / f".{INDEX}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({k: asdict(v) for k, v in self._entries.items()}, indent=1))
            f.flush()
            os.fsync(f.fileno())  # (renamed only once on disk: a crash leaves the old index or the new one)
        os.replace(tmp, self.folder / INDEX)
        stat = (self.folder / INDEX).stat()
        self._index_stamp = (stat.st_mtime_ns, stat.st_size)

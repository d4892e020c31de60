"""Prompt prefixes' keys and values, kept across requests (EngineConfig.prefix_cache_gb).

A prompt's first positions depend only on the voice: the instruction, the assistant header, the codec control
tags (language), the speaker (a preset's id or an x-vector) and, for an in-context voice, the positions of its
reference transcript (`q3tts.request.prompt.prefix_of` says which, mode by mode, from the layout in the spec). The
talker's keys and values there are the same for every request with that voice, so the first request computes them and
later ones copy them into their own KV blocks and prefill only the rest. Copied, not shared: a prefix is
tens of positions (an x-vector voice: ~10 of ~11 in streaming mode; a 10 s reference: its transcript's ~30-50
of ~140), less than a 64-position block, so sharing whole blocks copy-on-write would reuse nothing; a copy
costs one gather and one scatter per request. Entries are keyed by content (a digest of everything those
positions depend on), least recently used first out within the byte budget.

The codec keeps a second one (engine/runner/codec.py): its decoder state after an in-context voice's reference codes,
the codec stream's prefix, the same for every request with that reference.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

import torch

SEEN_ONCE_KEYS = 4096  # the keys `wants` remembers as missed once (the oldest forgotten first)


class PrefixCache:
    """Least recently used first out within `max_bytes`, counted by storage: entries made together as views of
    one tensor (a burst's prefixes, gathered in one copy) count it once, and it is freed, and uncounted, when the
    last entry holding it leaves."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str | bytes, tuple[torch.Tensor, ...]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.declined = 0  # entries `wants` turned down (seen once, with the budget full)
        self._storages: dict[int, list[int]] = {}  # storage address -> [bytes, entries holding it]
        self._seen_once: OrderedDict[str | bytes, None] = OrderedDict()

    def wants(self, key: str | bytes, nbytes: int) -> bool:
        """Whether an entry of about `nbytes` for `key`, just missed, is worth keeping: while it fits beside what is
        kept, always; once it would push entries out, only for a key missed before (among the last SEEN_ONCE_KEYS
        turned down), so that voices seen once (a new reference every request) neither evict the voices in use nor
        cost the copy that keeps them."""
        if self.bytes + nbytes <= self.max_bytes:
            return True
        if key in self._seen_once:  # (its second miss: kept, pushing the least recently used out)
            del self._seen_once[key]
            return True
        self._seen_once[key] = None
        if len(self._seen_once) > SEEN_ONCE_KEYS:
            self._seen_once.popitem(last=False)
        self.declined += 1
        return False

    def get(self, key: str | bytes) -> tuple[torch.Tensor, ...] | None:
        """The tensors kept for `key` (the talker's: keys and values [layers, positions, kv heads, head dim] of a
        prefix), or None."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str | bytes, *tensors: torch.Tensor) -> None:
        if key in self.entries:
            return
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        if sum(storages.values()) > self.max_bytes:
            return
        while True:  # (an eviction may uncount a storage this entry holds too)
            size = sum(n for address, n in storages.items() if address not in self._storages)
            if self.bytes + size <= self.max_bytes:
                break
            self._drop(self.entries.popitem(last=False)[1])
        self.entries[key] = tensors
        for address, n in storages.items():
            held = self._storages.setdefault(address, [n, 0])
            self.bytes += n if held[1] == 0 else 0
            held[1] += 1

    def _drop(self, tensors: tuple[torch.Tensor, ...]) -> None:
        for address in {t.untyped_storage().data_ptr() for t in tensors}:
            held = self._storages[address]
            held[1] -= 1
            if held[1] == 0:
                self.bytes -= held[0]
                del self._storages[address]


_DIGESTS: dict[int, tuple[weakref.ref, int, bytes]] = {}  # by id (tensors compare elementwise, so no weak dict)


def tensor_digest(t: torch.Tensor) -> bytes:
    """A digest of a tensor's dtype, shape and values (a content key for these caches), kept per tensor object (a
    voice's embedding and codes are the same objects request after request) until it changes in place."""
    return tensor_digests([t])[0]


def tensor_digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """`tensor_digest` of each tensor. Those not digested yet (a burst of new voices) are read to the host
    together, one copy per device, dtype and shape instead of a few calls and a copy each."""
    digests: dict[int, bytes] = {}
    groups: dict[tuple, dict[int, torch.Tensor]] = {}
    for t in tensors:
        hit = _DIGESTS.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == _version_of(t):
            digests[id(t)] = hit[2]
        else:
            groups.setdefault((t.device, t.dtype, tuple(t.shape)), {})[id(t)] = t
    for (_, dtype, shape), group in groups.items():
        members = list(group.values())
        with torch.no_grad():
            data = torch.stack(members).to("cpu").reshape(-1).view(torch.uint8).numpy()  # (in order, contiguous)
        size = len(data) // len(members)
        for i, t in enumerate(members):  # (SHA-256: ~2x BLAKE2b's speed where the CPU has SHA instructions)
            digest = hashlib.sha256(repr((dtype, shape)).encode())
            digest.update(data[i * size:(i + 1) * size])  # (the values' bytes, read in place)
            key = digests[id(t)] = digest.digest()[:16]
            _DIGESTS[id(t)] = (weakref.ref(t, _forget(id(t))), _version_of(t), key)
    return [digests[id(t)] for t in tensors]


def _forget(key: int):
    return lambda _: _DIGESTS.pop(key, None)  # (when the tensor is collected)


def _version_of(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # (inference tensors keep no version counter)

"""Prompt prefixes' keys and values, kept across requests (EngineConfig.prefix_cache_gb).

A prompt's first positions depend only on the voice: the instruction, the assistant header, the codec control
tags (language), the speaker (a preset's id or an x-vector) and, for an in-context voice, the positions of its
reference transcript (`q3tts.prompt.prefix_of` says which, mode by mode, from the layout in the spec). The talker's
keys and values there are the same for every request with that voice, so the first request computes them and
later ones copy them into their own KV blocks and prefill only the rest. Copied, not shared: a prefix is
tens of positions (an x-vector voice: ~10 of ~11 in streaming mode; a 10 s reference: its transcript's ~30-50
of ~140), less than a 64-position block, so sharing whole blocks copy-on-write would reuse nothing; a copy
costs one gather and one scatter per request. Entries are keyed by content (a digest of everything those
positions depend on), least recently used first out within the byte budget.

The codec keeps a second one (engine/codec.py): its decoder state after an in-context voice's reference codes,
the codec stream's prefix, the same for every request with that reference.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict

import torch


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str | bytes, tuple[torch.Tensor, ...]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

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
        size = _nbytes(tensors)
        if key in self.entries or size > self.max_bytes:
            return
        while self.bytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= _nbytes(old)
        self.entries[key] = tensors
        self.bytes += size


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_DIGESTS: dict[int, tuple[weakref.ref, int, bytes]] = {}  # by id (tensors compare elementwise, so no weak dict)


def tensor_digest(t: torch.Tensor) -> bytes:
    """A digest of a tensor's dtype, shape and values (a content key for these caches), kept per tensor object (a
    voice's embedding and codes are the same objects request after request) until it changes in place."""
    version = -1 if t.is_inference() else t._version  # (inference tensors keep no version counter)
    hit = _DIGESTS.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == version:
        return hit[2]
    data = t.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(repr((data.dtype, tuple(data.shape))).encode(), digest_size=16)
    digest.update(data.view(torch.uint8).numpy())  # (the values' bytes, read in place)
    digest = digest.digest()
    key = id(t)
    _DIGESTS[key] = (weakref.ref(t, lambda _: _DIGESTS.pop(key, None)), version, digest)
    return digest

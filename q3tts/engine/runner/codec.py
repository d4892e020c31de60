"""The codec side of the engine: each frame step's new frame of every row, decoded incrementally to PCM.

Rows are the model runner's rows: after `ModelRunner.step(B)`, `CodecRunner.step(B)` turns `state.codes[:B]`
into 1920 samples per row in `pcm[:B]` with one batched call of the streaming decoder (rows at any position),
captured as a CUDA graph per batch bucket at start-up like the language model's frame.

On CUDA the decode runs on a second stream: it snapshots the frame's codes and decodes them while the language
model computes the next frame; the next frame may only overwrite the codes once the snapshot is taken, so
each step costs about max(language model, codec) instead of their sum. Above `overlap_max_rows` (if set) the
language model waits for the decode instead. Measured in docs/perf-notes.md: overlap saves 8-16% per step
from 1 to 128 streams. The codec's graphs are captured on the codec's stream (graphs.py says why: graphs that
share a cuBLAS workspace raced on it when overlapped, perf-notes entries 22 and 32). PCM is copied to the host
from the codec's stream (`pcm_stream`) either way.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ...models.codec_decoder import CodecDecoder
from ...transfer import RowViews, set_row, set_rows
from .codec_stream import StreamingDecoder
from .graphs import capture_buckets, replay_or_run
from .prefix_cache import PrefixCache, tensor_digest


class CodecRunner:
    def __init__(self, decoder: CodecDecoder, codes: torch.Tensor, buckets: tuple[int, ...],
                 overlap_max_rows: int | None = None, cache_bytes: int = 0):
        """codes: the model runner's static [max_rows, 16] buffer of each row's newest frame. cache_bytes: the
        decoder states after in-context voices' references kept for reuse (0: none)."""
        self.references = PrefixCache(cache_bytes) if cache_bytes else None
        self.references_decoded = self.references_reused = 0  # in-context rows started by decoding / by a copy
        self.codes, self.buckets = codes, buckets
        self.inputs = torch.zeros_like(codes)  # the snapshot the decoder reads
        self.stream = StreamingDecoder(decoder, codes.shape[0])
        self.samples_per_frame = decoder.samples_per_frame
        self.pcm = torch.zeros(codes.shape[0], self.samples_per_frame, device=codes.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._rows: RowViews | None = None  # views of the state's rows (start, move_rows)
        self.overlap_max_rows = overlap_max_rows
        self.pcm_stream = torch.cuda.Stream() if codes.device.type == "cuda" else None
        self._ready, self._taken, self._decoded = ((torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event())
                                                   if self.pcm_stream else (None, None, None))

    def start(self, rows: list[int], ref_codes: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Fresh decoder state for `rows`; a voice's reference codes are decoded into the state (their audio is
        discarded), so the stream continues exactly as decoding reference + new frames together. A reference
        is decoded once: rows with the same reference codes (in this call, or kept from an earlier one) get a
        copy of the state it left, all of them in one broadcast copy per state tensor. Runs on the codec's stream,
        after any decode still in flight. Returns per row the reference audio's last sample as a host tensor [1]
        (None without reference codes), valid once the row's first frame is read back (the official in-context
        cut can keep it: see `q3tts.api.official`)."""
        state = self.stream.state.tensors()
        # (tensor_digest keeps a digest per tensor object: a voice's codes are hashed once)
        keys = [tensor_digest(ref) if ref is not None and ref.shape[0] else None for ref in ref_codes]
        voices: dict[bytes, tuple[torch.Tensor, list[int]]] = {}  # reference digest -> (codes, rows starting from it)
        for row, key, ref in zip(rows, keys, ref_codes):
            if key is not None:
                voices.setdefault(key, (ref, []))[1].append(row)
        lasts: dict[bytes, torch.Tensor] = {}
        with self._on_codec_stream():
            self._views().zero(rows)  # (StreamingDecoder.reset, with the rows' views made once)
            for key, (ref, voice_rows) in voices.items():
                kept = self.references.get(key) if self.references is not None else None
                if kept is None:
                    first, voice_rows = voice_rows[0], voice_rows[1:]
                    self.references_decoded += 1
                    audio = self.stream.decode_rows([first], ref.T[None])
                    last = audio[0, -1:].to(torch.float32, copy=True)  # (kept: not a view of the whole audio)
                    keep = self.references is not None and self.references.wants(key, self.state_bytes)
                    # (not kept: this call's other rows copy the first's state as it is now, in stream order)
                    kept = (*(t[first].clone() if keep else t[first] for t in state), last)
                    if keep:
                        self.references.put(key, *kept)
                if voice_rows:
                    set_rows(state, voice_rows, list(kept[:len(state)]))
                    self.references_reused += len(voice_rows)
                lasts[key] = kept[-1]
            if not voices:
                return [None] * len(rows)
            with_ref = [key for key in keys if key is not None]  # their last samples to the host in one copy
            on_host = torch.empty(len(with_ref), pin_memory=self.pcm_stream is not None)
            on_host.copy_(torch.cat([lasts[key] for key in with_ref]), non_blocking=True)
        tails, i = [], 0
        for key in keys:
            tails.append(on_host[i:i + 1] if key is not None else None)
            i += key is not None
        return tails

    def move_rows(self, moves: list[tuple[int, int]]) -> None:
        """Moves streams' decoder states, row src to row dst for each (src, dst) (see ModelRunner.remove_rows), on
        the codec's stream."""
        if moves:
            with self._on_codec_stream():
                self._views().copy(moves)

    @property
    def state_bytes(self) -> int:
        """One row's decoder state, in bytes."""
        return sum(t[0].numel() * t.element_size() for t in self.stream.state.tensors())

    def _views(self) -> RowViews:
        if self._rows is None:
            self._rows = RowViews(self.stream.state.tensors())
        return self._rows

    def swap_out(self, row: int) -> list[torch.Tensor]:
        """A copy of the row's decoder state (kept on the device; see ModelRunner.swap_out)."""
        with self._on_codec_stream():
            return [t[row].clone() for t in self.stream.state.tensors()]

    def swap_in(self, row: int, saved: list[torch.Tensor]) -> None:
        with self._on_codec_stream():
            set_row(self.stream.state.tensors(), row, saved)

    def _on_codec_stream(self):
        return torch.cuda.stream(self.pcm_stream) if self.pcm_stream is not None else nullcontext()

    @torch.no_grad()
    def step(self, num_rows: int) -> None:
        B = next(b for b in self.buckets if b >= num_rows)
        if self.pcm_stream is None:
            self._snapshot_and_decode(B)
            return
        main = torch.cuda.current_stream()
        self._ready.record(main)
        self.pcm_stream.wait_event(self._ready)
        with torch.cuda.stream(self.pcm_stream):
            self._snapshot_and_decode(B)
            self._decoded.record()
        # The next frame may overwrite the codes once they are copied; without overlap, once they are decoded.
        overlap = self.overlap_max_rows is None or self.overlap_max_rows >= B
        main.wait_event(self._taken if overlap else self._decoded)

    def _snapshot_and_decode(self, B: int) -> None:
        self.inputs[:B].copy_(self.codes[:B])
        if self._taken is not None:
            self._taken.record()
        replay_or_run(self.graphs, self.decode, B)

    def decode(self, B: int) -> None:
        """One codec step of the first B rows' snapshotted codes (what a codec graph replays)."""
        self.pcm[:B] = self.stream.decode(self.inputs[:B, :, None]).float()

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """One graph per bucket, largest first, one pool; call before any stream starts (it resets every row)."""
        if self.codes.device.type != "cuda":
            return
        # On the codec's own stream, where its eager work runs too (see graphs.py).
        self.graphs = capture_buckets(self.decode, self.buckets, self.pcm_stream)
        self.stream.reset(list(range(self.codes.shape[0])))

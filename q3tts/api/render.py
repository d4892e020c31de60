"""`Renderer`: the whole audio of a list of requests (`TTS.synthesize_all` and the official drop-in methods), run as
rows of the engine's batch (or on the eager reference loop), decoded as the official code decodes a call.

On the CPU the finished codes are decoded again as the official code decodes a call's items (one padded batch,
`decode`): in float32 the vocoder amplifies rounding, so the engine's incremental decode, as exact as the official
one against float64, can be ~1e-4 away from it, while this decode is the official's, bit for bit at equal thread
counts (docs/faithfulness.md). On a GPU the streamed decode is returned: a second decode would cost as much GPU
time as the first, for no gain in bfloat16.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..engine import QueueFull, RequestStream
from ..reference import generate_codes
from ..request.builder import Request
from ..request.prompt import build_prompts
from .engine_host import EngineHost


class Renderer:
    """Renders requests on `host`'s engine (or its reference loop), decoding with its speech tokenizer."""

    def __init__(self, host: EngineHost):
        self.host = host

    def render(self, requests: list[Request], official_cut: bool,
               on_frame: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """The audio of `requests`, in order. `official_cut`: an in-context voice's reference share is cut as the
        official code does (float truncation, which can keep the reference audio's last sample). `on_frame(n)` is
        called as frames are produced (n: frames so far of the request)."""
        if self.host.reference:
            return self.render_reference(requests, official_cut, on_frame)
        streams = self.submit_all(requests)
        whole = self.host.engine.device.type == "cpu"
        wavs = []
        with cancelled_on_exit(streams):
            for request, stream in zip(requests, streams):
                frames = []
                for frame in stream:
                    frames.append(frame)
                    if on_frame is not None:
                        on_frame(len(frames))
                if whole:  # (decoded below, all together)
                    continue
                wav = np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
                ref = request.spec.ref_codes
                if official_cut and ref is not None and official_extra(ref.shape[0], len(frames), self.spf):
                    wav = np.concatenate([stream.channel.ref_tail.numpy(), wav])
                wavs.append(wav)
        if whole:
            codes = [torch.from_numpy(np.stack(s.channel.codes)) if s.channel.codes else
                     torch.zeros(0, 16, dtype=torch.long) for s in streams]
            return self.decode(requests, codes, official_cut)
        return wavs

    def submit_all(self, requests: list[Request]) -> list[RequestStream]:
        """Submits every request (their prompts built together); when the engine's queue is full, waits for earlier
        ones before going on."""
        streams: list[RequestStream] = []
        with cancelled_on_exit(streams):
            for request, prompt in zip(requests, self.host.prepare_many(requests)):
                while True:
                    try:
                        streams.append(self.host.submit(request, prompt=prompt, realtime=False))
                        break
                    except QueueFull:
                        if all(s.finished for s in streams):
                            raise
                        time.sleep(0.01)
        return streams

    def render_reference(self, requests: list[Request], official_cut: bool,
                         on_frame: Callable[[int], None] | None) -> list[np.ndarray]:
        """`render` on the eager fp32 reference loop."""
        talker = self.host.model.talker
        prompts = build_prompts(talker, self.host.model.config, [r.spec for r in requests])
        steps = iter(range(1, 1 << 62))
        codes = generate_codes(talker, prompts, [r.params for r in requests],
                               on_frame and (lambda _: on_frame(next(steps))))
        return self.decode(requests, codes, official_cut)

    def decode(self, requests: list[Request], codes: list[torch.Tensor], official_cut: bool) -> list[np.ndarray]:
        """The requests' generated codes (each after its in-context reference's) decoded as the official code
        decodes one call's items, then each cut to its own share."""
        refs = [r.spec.ref_codes for r in requests]
        full = [torch.cat([r.cpu(), c]) if r is not None else c for r, c in zip(refs, codes)]
        wavs = self.host.speech_tokenizer.decode(full)
        cuts = [0 if r is None else r.shape[0] * self.spf - (official_cut and official_extra(
                r.shape[0], c.shape[0], self.spf)) for r, c in zip(refs, codes)]
        return [w[cut:] for w, cut in zip(wavs, cuts)]

    @property
    def spf(self) -> int:
        """Samples per codec frame."""
        return self.host.speech_tokenizer.decoder.samples_per_frame


@contextlib.contextmanager
def cancelled_on_exit(streams: list[RequestStream]) -> Iterator[None]:
    """Cancels `streams` (as they are then) if the block raises, Ctrl-C included: an interrupted `synthesize`
    frees its rows at once (the caller's traceback, which a REPL keeps, would otherwise keep them generating)."""
    try:
        yield
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise


def official_extra(ref_frames: int, new_frames: int, samples_per_frame: int) -> bool:
    """Whether the official in-context cut, int(ref / total * len(audio)) in floating point, keeps one sample of
    the reference's audio (the product can round just below ref * samples_per_frame; never by more than one)."""
    total = ref_frames + new_frames
    return int(ref_frames / total * (total * samples_per_frame)) < ref_frames * samples_per_frame

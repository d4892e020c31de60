"""`speed`: streaming, pitch-preserving time stretch with FFmpeg's `atempo` filter (WSOLA), through PyAV.

One `atempo` stage takes factors in [0.5, 2]; wider factors chain stages (0.25 = 0.5 x 0.5, 4 = 2 x 2). The
output is `round(len(input) / speed)` samples in all, to the sample (the filter alone ends a few ms off that,
and below speed 1 short of the input's end: see TAIL_PADDING_SECONDS).
"""

from __future__ import annotations

import av
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0
# At the end of the stream atempo emits its last fragment only, which below tempo 1 stops short of the input's end
# (by about window / 2 x (1 / tempo - 1); its window is ~43 ms at 24 kHz): speed 0.5 lost ~20-35 ms of the audio's
# end, 0.25 ~50 ms. This much silence sent after the input carries the tail out; the output is then cut to length.
TAIL_PADDING_SECONDS = 0.1


def atempo_factors(speed: float) -> list[float]:
    """Factors within atempo's [0.5, 2] range whose product is `speed`."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    return [*factors, speed]


class TimeStretch:
    def __init__(self, speed: float, sample_rate: int):
        self.speed, self.sample_rate, self.pts = speed, sample_rate, 0
        self.num_out = 0  # samples handed out
        self.graph = av.filter.Graph()
        source = self.graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono",
                                        time_base=f"1/{sample_rate}")
        stages = [self.graph.add("atempo", f"{factor:.6f}") for factor in atempo_factors(speed)]
        self.graph.link_nodes(source, *stages, self.graph.add("abuffersink")).configure()
        self.flushed = False

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Stretched audio available so far (may be empty while the filter fills its window)."""
        self._push(pcm)
        out = self._pull()
        self.num_out += len(out)
        return out

    def flush(self) -> np.ndarray:
        """The rest: `round(samples in / speed)` samples in all."""
        if self.flushed:
            return np.zeros(0, dtype=np.float32)
        self.flushed = True
        num_in = self.pts
        self._push(np.zeros(round(TAIL_PADDING_SECONDS * self.sample_rate), dtype=np.float32))
        self.graph.push(None)
        tail = self._pull()
        wanted = max(0, round(num_in / self.speed) - self.num_out)
        tail = np.pad(tail[:wanted], (0, max(0, wanted - len(tail))))
        self.num_out += len(tail)
        return tail

    def _push(self, pcm: np.ndarray) -> None:
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt",
                                               layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self.pts
            self.pts += len(pcm)
            self.graph.push(frame)

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)

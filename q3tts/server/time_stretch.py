"""`speed`: streaming, pitch-preserving time stretch with FFmpeg's `atempo` filter (WSOLA), through PyAV.

One `atempo` stage takes factors in [0.5, 2]; wider factors chain stages (0.25 = 0.5 x 0.5, 4 = 2 x 2). The
output is about `len(input) / speed` samples (the filter's windowing rounds the total to within a few ms).
"""

from __future__ import annotations

import av
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0


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
        self.sample_rate, self.pts = sample_rate, 0
        self.graph = av.filter.Graph()
        source = self.graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono",
                                        time_base=f"1/{sample_rate}")
        stages = [self.graph.add("atempo", f"{factor:.6f}") for factor in atempo_factors(speed)]
        self.graph.link_nodes(source, *stages, self.graph.add("abuffersink")).configure()
        self.flushed = False

    def process(self, pcm: np.ndarray) -> np.ndarray:
        """Stretched audio available so far (may be empty while the filter fills its window)."""
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt",
                                               layout="mono")
            frame.sample_rate, frame.pts = self.sample_rate, self.pts
            self.pts += len(pcm)
            self.graph.push(frame)
        return self._pull()

    def flush(self) -> np.ndarray:
        if self.flushed:
            return np.zeros(0, dtype=np.float32)
        self.flushed = True
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)

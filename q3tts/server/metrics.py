"""Prometheus metrics, in a registry of the app's own (several apps may live in one process, e.g. in tests).

- `q3tts_queue_depth`, `q3tts_running_streams`: the engine's waiting and running requests (read at scrape).
- `q3tts_frames_generated_total`, `q3tts_engine_requests_{finished,cancelled}_total`, `q3tts_engine_errors_total`:
  the engine's own counters (read at scrape).
- `q3tts_prefix_cache_{hits,misses}_total`: prompts whose voice prefix was reused / computed
  (engine/runner/prefix_cache.py).
- `q3tts_codec_references_{reused,decoded}_total`: in-context streams whose codec state after the reference was
  copied (same reference as another stream, now or kept) / decoded (engine/runner/codec.py).
- `q3tts_time_to_first_audio_seconds`: submission -> first 80 ms frame, per request.
- `q3tts_real_time_factor`: wall seconds (submission -> end) per second of audio, per finished request; below 1
  is faster than real time.
- `q3tts_requests_total{route,method,status}`, `q3tts_errors_total{code}`: HTTP answers and refusals/failures.
  A WebSocket session counts once, as it ends, with method "WS" and as status the close code it ended with (the
  server's, else the client's: 1000 done, 1008 bad input, 1011 server failure, 1013 queue full, 1012 closed at
  shutdown), or the HTTP status of a refused handshake (401).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
RTF_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class ServerMetrics:
    """Also the engine's observer: `on_first_audio` / `on_finish` are called from the engine thread."""

    def __init__(self, namespace: str = "q3tts", engine: bool = True):
        """`engine=False`: the HTTP counters alone, named `<namespace>_...` (the `--devices` front's own)."""
        self.registry = CollectorRegistry()
        self.engine_source: Callable[[], Any] = lambda: None  # the AsyncEngine, once it exists
        self.requests = Counter(f"{namespace}_requests", "HTTP responses and WebSocket sessions",
                                ["route", "method", "status"], registry=self.registry)
        self.errors = Counter(f"{namespace}_errors", "Refused or failed requests, by error code", ["code"],
                              registry=self.registry)
        if not engine:
            return
        self.ttfa = Histogram("q3tts_time_to_first_audio_seconds", "Submission to first audio frame",
                              buckets=TTFA_BUCKETS, registry=self.registry)
        self.rtf = Histogram("q3tts_real_time_factor", "Wall seconds per audio second of a finished request",
                             buckets=RTF_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def on_first_audio(self, seconds: float) -> None:
        self.ttfa.observe(seconds)

    def on_finish(self, audio_seconds: float, wall_seconds: float) -> None:
        if audio_seconds > 0:
            self.rtf.observe(wall_seconds / audio_seconds)

    def count_error(self, code: str | None) -> None:
        self.errors.labels(code or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine_source()
        m = engine.metrics if engine is not None else None
        yield GaugeMetricFamily("q3tts_queue_depth", "Requests waiting for a row",
                                value=engine.num_waiting if engine else 0)
        yield GaugeMetricFamily("q3tts_running_streams", "Requests generating now",
                                value=engine.num_running if engine else 0)
        prefixes = engine.runner.prefix_cache if engine else None
        codec = engine.codec if engine else None
        for source, name, doc, attr in (
                (m, "q3tts_frames_generated", "Codec frames (80 ms each) delivered", "frames"),
                (m, "q3tts_engine_requests_submitted", "Requests queued on the engine", "requests_submitted"),
                (m, "q3tts_engine_requests_finished", "Requests that ran to the end", "requests_finished"),
                (m, "q3tts_engine_requests_cancelled", "Requests cancelled while running", "requests_cancelled"),
                (m, "q3tts_engine_errors", "Engine failures", "errors"),
                (prefixes, "q3tts_prefix_cache_hits", "Prompts whose voice prefix was reused", "hits"),
                (prefixes, "q3tts_prefix_cache_misses", "Prompts whose voice prefix was computed", "misses"),
                (prefixes, "q3tts_prefix_cache_declined", "Voice prefixes computed and not kept: seen once, with the "
                 "cache full", "declined"),
                (codec, "q3tts_codec_references_reused", "In-context streams whose codec state after the reference "
                 "was copied", "references_reused"),
                (codec, "q3tts_codec_references_decoded", "In-context streams whose reference the codec decoded",
                 "references_decoded")):
            yield CounterMetricFamily(name, doc, value=getattr(source, attr) if source is not None else 0)
        reasons = CounterMetricFamily("q3tts_requests_ended", "Requests that ran to their end, by finish reason "
                                      "(eos, length, runaway, repetition)", labels=["reason"])
        for reason, count in (m.finish_reasons.items() if m else ()):
            reasons.add_metric([reason], count)
        yield reasons

    def describe(self):
        return []

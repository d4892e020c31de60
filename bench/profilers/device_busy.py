"""How busy the GPU is while the engine serves: a window of the process's CUDA activity (every stream, whichever
thread launched it: CUPTI's record, through torch.profiler with CUDA activity alone), summarised as the share of the
window in which any kernel or copy ran, each stream's share, the main stream's gaps, and the streams' top kernels.

The engine's frame and prefill run on the main stream, the codec's decode on its own (`CodecRunner.pcm_stream`);
the gaps of the main stream are where it waited for the host (a frame's launch) or for a decode it depends on.
`bench/serve_load.py --device-trace START,SECONDS` records one window in each rate (GPU machine only).
"""

from __future__ import annotations

import asyncio
import collections
import json
import tempfile
from pathlib import Path

GAP_US = 20.0  # a main-stream gap shorter than this is launch latency, not counted as a gap


async def traced(work, start_s: float, seconds: float) -> tuple[object, dict]:
    """Runs the coroutine `work`; from `start_s` after its start, records `seconds` of CUDA activity. Returns
    (work's result, `summary` of the window, or {"error": ...} where the profiler could not run). The trace is
    read once `work` is done (exporting it takes seconds, which would stall the work's event loop); stopping the
    profiler (which collects the window's records) and what CUPTI costs the host while it records (each launch)
    still slow the work then: a traced rate's latencies are not those of an untraced one."""
    from torch.profiler import ProfilerActivity, profile

    async def window():
        await asyncio.sleep(start_s)
        try:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:  # (a measurement left out, not a failed run)
            return {"error": f"profiler: {e}"}
        try:
            await asyncio.sleep(seconds)
        finally:  # (in the thread that started it: the profiler's state is the thread's)
            prof.__exit__(None, None, None)
        return prof

    result, prof = await asyncio.gather(work, window())
    if isinstance(prof, dict):
        return result, prof
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return result, summary(json.loads(path.read_text())["traceEvents"])


def summary(events: list[dict], top: int = 8) -> dict:
    """The window's device activity from chrome-trace events (kernels, copies and memsets: "X" events with a
    stream): its span, the busy share (union of intervals) in all and per stream, the main stream's gaps (the
    stream with the most kernel time is taken as the main one unless named), and each stream's top kernels."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("args", {}).get("stream"), e)
             for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not spans:
        return {"events": 0}
    t0, t1 = min(s[0] for s in spans), max(s[1] for s in spans)
    by_stream: dict = collections.defaultdict(list)
    for start, end, stream, _ in spans:
        by_stream[stream].append((start, end))
    streams = {}
    for stream, intervals in by_stream.items():
        kernels = collections.Counter()
        for start, end, s, e in spans:
            if s == stream:
                kernels[e["name"][:80]] += end - start
        streams[str(stream)] = {"busy_share": round(_union(intervals) / (t1 - t0), 4), "events": len(intervals),
                                "top_ms": {name: round(us / 1e3, 3) for name, us in kernels.most_common(top)}}
    main = max(by_stream, key=lambda s: sum(end - start for start, end in by_stream[s]))
    gaps = _gaps(by_stream[main])
    return {"events": len(spans), "window_ms": round((t1 - t0) / 1e3, 2),
            "busy_share": round(_union([(s[0], s[1]) for s in spans]) / (t1 - t0), 4),
            "main_stream": str(main), "main_gaps": len(gaps), "main_gap_ms": round(sum(gaps) / 1e3, 2),
            "main_gap_ms_p50": round(_quantile(gaps, 0.5) / 1e3, 3) if gaps else None,
            "streams": streams}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle stretches between one stream's activity, longer than GAP_US."""
    gaps, reach = [], None
    for start, end in sorted(intervals):
        if reach is not None and start - reach > GAP_US:
            gaps.append(start - reach)
        reach = end if reach is None else max(reach, end)
    return gaps


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

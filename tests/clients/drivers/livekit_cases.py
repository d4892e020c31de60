"""Runs examples/livekit_tts.py's `synthesize` for each case in one process (LiveKit takes seconds to import), with
the LiveKit environment's Python: `python livekit_cases.py BASE_URL TEXT CASES_JSON OUT_DIR`. Writes each case's
audio to OUT_DIR/<i>.wav and prints one JSON line per case: its error, if any."""

from __future__ import annotations

import asyncio
import json
import sys
import wave
from pathlib import Path

from livekit_tts import synthesize  # (examples/: on PYTHONPATH, set by tests/clients/test_livekit.py)


def main() -> None:
    base_url, text, cases, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    for i, case in enumerate(cases):
        try:
            frame = asyncio.run(synthesize(text, base_url, **case))
        except Exception as e:  # reported per case: the others still run
            print(json.dumps({"error": f"{type(e).__name__}: {e!r} {e.__cause__!r}"}), flush=True)
            continue
        with wave.open(str(out / f"{i}.wav"), "wb") as f:
            f.setnchannels(frame.num_channels)
            f.setsampwidth(2)
            f.setframerate(frame.sample_rate)
            f.writeframes(bytes(frame.data))
        print(json.dumps({"error": None}), flush=True)


if __name__ == "__main__":
    main()

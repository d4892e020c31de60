"""LiveKit Agents with q3tts: the OpenAI plugin's TTS pointed at `q3tts serve`.

    pip install livekit-agents==1.8.9 livekit-plugins-openai==1.8.9
    q3tts serve Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice          # http://127.0.0.1:8000
    python examples/livekit_tts.py "Hello from LiveKit." -o livekit.wav

The one line: `openai.TTS(base_url="http://127.0.0.1:8000/v1", api_key="not-needed")`. In an agent it is the
session's TTS, and nothing else changes:

    from livekit.agents import AgentSession
    from livekit.plugins import openai
    session = AgentSession(stt=..., llm=..., tts=openai.TTS(base_url="http://127.0.0.1:8000/v1", api_key="not-needed"))

The plugin sends one request per sentence, with OpenAI's voice names (its default is `ash`, which q3tts maps to a
voice of the loaded checkpoint), mp3 unless `response_format` says otherwise, and `stream_format` "sse" except for
tts-1 / tts-1-hd. A LiveKit room needs a LiveKit server; this script calls the same `synthesize` the agent does
and writes its frames to a WAV file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

from livekit import rtc
from livekit.plugins import openai


async def synthesize(text: str, base_url: str, **options: str) -> rtc.AudioFrame:
    """All frames of `tts.synthesize(text)`, joined into one."""
    tts = openai.TTS(base_url=base_url, api_key="not-needed", **options)
    try:
        async with tts.synthesize(text) as stream:
            return rtc.combine_audio_frames([event.frame async for event in stream])
    finally:
        await tts.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text")
    parser.add_argument("-o", "--output", default="livekit.wav")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--voice", help="default: the plugin's (ash)")
    parser.add_argument("--model", help="default: the plugin's (gpt-4o-mini-tts)")
    parser.add_argument("--response-format", help="default: the plugin's (mp3)")
    args = parser.parse_args()
    options = {k: v for k, v in (("voice", args.voice), ("model", args.model),
                                 ("response_format", args.response_format)) if v}
    frame = asyncio.run(synthesize(args.text, args.base_url, **options))
    with wave.open(args.output, "wb") as out:
        out.setnchannels(frame.num_channels)
        out.setsampwidth(2)
        out.setframerate(frame.sample_rate)
        out.writeframes(bytes(frame.data))
    print(f"{args.output}: {frame.samples_per_channel} samples at {frame.sample_rate} Hz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

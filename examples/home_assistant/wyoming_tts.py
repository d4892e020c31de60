"""Speaks to a Wyoming TTS service as Home Assistant does, and writes what it answers to a WAV file.

    pip install wyoming==1.10.2
    python examples/home_assistant/wyoming_tts.py "Turning on the lights." -o ha.wav --uri tcp://127.0.0.1:10300

With the `wyoming_openai` bridge in front of `q3tts serve` (see README.md beside this file) this is the path of a
Home Assistant voice assistant's reply. `--stream` sends the text as Home Assistant 2025.7+ does for a program
that supports streaming (synthesize-start, synthesize-chunk per piece, the whole text as synthesize for older
servers, synthesize-stop); otherwise one synthesize event. `--describe` prints the voices the service offers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import wave
from urllib.parse import urlsplit

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped, SynthesizeVoice


async def describe(host: str, port: int) -> dict[str, list[str]]:
    """The service's TTS programs and their voices' names, from its `info` answer to `describe`."""
    async with AsyncTcpClient(host, port) as client:
        await client.write_event(Describe().event())
        while not Info.is_type((event := await client.read_event()).type):
            pass
    info = Info.from_event(event)
    return {program.name: [voice.name for voice in program.voices] for program in info.tts}


async def synthesize(host: str, port: int, text: str, voice: str | None, stream: bool,
                     timeout: float = 60) -> tuple[bytes, int]:
    """(16-bit PCM, sample rate) of the service's answer to one request."""
    chosen = SynthesizeVoice(name=voice) if voice else None
    async with AsyncTcpClient(host, port) as client:
        if stream:
            await client.write_event(SynthesizeStart(voice=chosen).event())
            for piece in text.split(" "):
                await client.write_event(SynthesizeChunk(text=piece + " ").event())
            await client.write_event(Synthesize(text=text, voice=chosen).event())
            await client.write_event(SynthesizeStop().event())
        else:
            await client.write_event(Synthesize(text=text, voice=chosen).event())
        return await asyncio.wait_for(_read_audio(client, stream), timeout)


async def _read_audio(client: AsyncTcpClient, stream: bool) -> tuple[bytes, int]:
    pcm, rate = bytearray(), 0
    while (event := await client.read_event()) is not None:
        if Error.is_type(event.type):
            raise RuntimeError(f"the service answered an error: {Error.from_event(event).text}")
        if AudioStart.is_type(event.type):
            rate = AudioStart.from_event(event).rate
        elif AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            if (chunk.width, chunk.channels) != (2, 1):
                raise RuntimeError(f"expected 16-bit mono audio, got {chunk.width * 8}-bit x{chunk.channels}")
            pcm += chunk.audio
        elif (AudioStop.is_type(event.type) and not stream) or SynthesizeStopped.is_type(event.type):
            return bytes(pcm), rate
    raise RuntimeError("the service closed the connection before the audio ended")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", nargs="?", default="Turning on the lights.")
    parser.add_argument("-o", "--output", default="wyoming.wav")
    parser.add_argument("--uri", default="tcp://127.0.0.1:10300", help="the Wyoming service (the bridge)")
    parser.add_argument("--voice", help="a voice name the service offers (default: its first)")
    parser.add_argument("--stream", action="store_true", help="stream the text in as Home Assistant 2025.7+ does")
    parser.add_argument("--describe", action="store_true", help="print the service's TTS voices and exit")
    args = parser.parse_args()
    uri = urlsplit(args.uri)
    if args.describe:
        print(json.dumps(asyncio.run(describe(uri.hostname, uri.port)), indent=2))
        return 0
    pcm, rate = asyncio.run(synthesize(uri.hostname, uri.port, args.text, args.voice, args.stream))
    with wave.open(args.output, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm)
    print(f"{args.output}: {len(pcm) // 2} samples at {rate} Hz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

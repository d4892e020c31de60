"""The openai SDK with q3tts: speech streamed to a file as it is generated.

    pip install openai==3.57.0
    q3tts serve Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice          # http://127.0.0.1:8000
    python examples/openai_stream_to_file.py "Hello from the SDK." -o hello.wav

The one line: `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="not-needed")`. OpenAI's model ids and voice
names work unchanged (q3tts maps each voice name to a voice of the loaded checkpoint); so do q3tts's own speakers
and stored voices (`GET /v1/audio/voices`), and its extra fields through `extra_body` (`language`, `seed`,
`sample_rate`, `max_new_tokens`, ...). A streamed WAV carries the open-ended header of a stream of unknown length.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text")
    parser.add_argument("-o", "--output", default="speech.wav")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--voice", default="alloy")
    parser.add_argument("--model", default="gpt-4o-mini-tts")
    parser.add_argument("--format", default=None, help="mp3, opus, aac, flac, wav or pcm (default: the file's suffix)")
    parser.add_argument("--instructions", default=None, help="how to speak (1.7B CustomVoice and VoiceDesign models)")
    args = parser.parse_args()
    response_format = args.format or Path(args.output).suffix.lstrip(".") or "wav"
    client = OpenAI(base_url=args.base_url, api_key="not-needed")
    extra = {"instructions": args.instructions} if args.instructions else {}
    with client.audio.speech.with_streaming_response.create(model=args.model, voice=args.voice, input=args.text,
                                                            response_format=response_format, **extra) as response:
        response.stream_to_file(args.output)
        rate = response.headers.get("x-sample-rate", "?")
    print(f"{args.output}: {Path(args.output).stat().st_size} bytes of {response_format} at {rate} Hz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

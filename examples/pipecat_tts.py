"""Pipecat with q3tts: a real `Pipeline` whose TTS is Pipecat's own `OpenAITTSService`, pointed at `q3tts serve`.

    pip install pipecat-ai==1.14.0
    q3tts serve Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice          # or any checkpoint; http://127.0.0.1:8000
    python examples/pipecat_tts.py "Hello from Pipecat." -o pipecat.wav

The one line that matters is `OpenAITTSService(base_url="http://127.0.0.1:8000/v1", api_key="not-needed")`.
Pipecat asks for 24 kHz 16-bit PCM and accepts only OpenAI's voice names (alloy, ash, ..., verse): q3tts maps
each of them to a voice of the loaded checkpoint (`GET /v1/audio/voices` lists the mapping). In a voice bot the
service sits between the LLM and the transport's output; here the audio lands in a WAV file instead of a call.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

from pipecat.frames.frames import EndFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner


class WavSink(FrameProcessor):
    """The end of the pipeline: keeps the TTS audio (a transport would play it) and passes every frame on."""

    def __init__(self) -> None:
        super().__init__()
        self.pcm = bytearray()
        self.sample_rate: int | None = None

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.pcm += frame.audio
            self.sample_rate = frame.sample_rate
        await self.push_frame(frame, direction)


async def speak(text: str, base_url: str, voice: str, model: str) -> tuple[WavSink, list[str]]:
    """Runs TTSSpeakFrame(text) then EndFrame through Pipeline([tts, sink]); returns the sink and any errors."""
    tts = OpenAITTSService(base_url=base_url, api_key="not-needed",
                           settings=OpenAITTSService.Settings(voice=voice, model=model))
    sink = WavSink()
    task = PipelineWorker(Pipeline([tts, sink]), params=PipelineParams(audio_out_sample_rate=24000),
                          idle_timeout_secs=None, enable_rtvi=False)
    errors: list[str] = []

    @task.event_handler("on_pipeline_error")
    async def on_error(_task, frame) -> None:
        errors.append(frame.error)

    await task.queue_frames([TTSSpeakFrame(text), EndFrame()])
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    await runner.run()
    return sink, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text")
    parser.add_argument("-o", "--output", default="pipecat.wav")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--voice", default="alloy", help="one of OpenAI's voice names (Pipecat allows no other)")
    parser.add_argument("--model", default="gpt-4o-mini-tts", help="Pipecat's default; q3tts accepts OpenAI's ids")
    args = parser.parse_args()
    sink, errors = asyncio.run(speak(args.text, args.base_url, args.voice, args.model))
    if errors or not sink.pcm:
        print(f"no audio: {errors or 'the pipeline produced none'}", file=sys.stderr)
        return 1
    with wave.open(args.output, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sink.sample_rate)
        out.writeframes(bytes(sink.pcm))
    print(f"{args.output}: {len(sink.pcm) // 2 / sink.sample_rate:.2f} s at {sink.sample_rate} Hz")
    return 0


if __name__ == "__main__":
    sys.exit(main())

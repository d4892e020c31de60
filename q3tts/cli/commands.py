"""`q3tts` command line: `say` synthesises to a WAV file, `voice create` saves a cloned voice, `serve` runs the
HTTP server."""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import time
import warnings
from pathlib import Path

from ..errors import RequestError, quote, renamed

DEFAULT_MODEL = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"
DEFAULT_SPEAKER = "ryan"
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_k",
                  "subtalker_top_p", "max_new_tokens")
# Python argument names in error messages -> this command line's flags.
FLAG_NAMES = {name: "--" + name.replace("_", "-") for name in (*SAMPLING_FLAGS, "max_context", "kv_cache_gb",
                                                               "gpu_memory_utilization", "ref_text", "ref_audio",
                                                               "max_rows")}
# `q3tts serve`: the server's and engine's setting names -> its flags.
SERVE_FLAG_NAMES = {"max_rows": "--max-running", "body_timeout_s": "--body-timeout", "send_timeout_s": "--send-timeout",
                    "drain_timeout_s": "--drain-timeout"}
SERVE_FLAG_NAMES |= {name: "--" + name.replace("_", "-") for name in (
    "max_waiting", "max_input_chars", "max_context", "kv_cache_gb", "gpu_memory_utilization", "prefix_cache_gb",
    "max_body_bytes", "port", "voices_dir", "default_voice")}
SERVE_FLAG_NAMES |= {"voice_aliases": "--voice-alias"}
FLAG_NAMES |= {"do_sample=False": "--greedy", "do_sample": "--greedy", "subtalker_dosample=False": "--greedy",
               "subtalker_dosample": "--greedy",
               "x_vector_only_mode=False": "without --x-vector-only", "x_vector_only_mode": "--x-vector-only",
               "text": "the text", "speaker": "--speaker", "voice": "--voice", "instruct": "--instruct",
               "language": "--language", "seed": "--seed"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            if args.run is not _serve:  # (a server's warnings are about its clients' fields, not these flags)
                warnings.showwarning = _show_warning
            return args.run(args)
    except RequestError as e:
        print(f"q3tts: error: {_flag_message(e)}", file=sys.stderr)
    except (ValueError, TypeError, OSError, MemoryError) as e:  # AudioError, CheckpointError, ConfigError, ...
        print(f"q3tts: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("q3tts: interrupted", file=sys.stderr)
        return 130
    return 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings in this command line's terms (argument names as flags), one line each."""
    print(f"q3tts: warning: {renamed(str(message), FLAG_NAMES)}", file=sys.stderr)


def _flag_message(e: RequestError) -> str:
    """The error's message in this command line's terms: argument names as flags, also the bare leading one
    ("temperature must be a finite number > 0" -> "--temperature must be ...")."""
    message = e.renamed(FLAG_NAMES)
    if e.param in FLAG_NAMES and message.startswith(f"{e.param} "):
        message = FLAG_NAMES[e.param] + message[len(e.param):]
    return message


def _help(parser: argparse.ArgumentParser):
    """A command of subcommands run without one: its own help (as argparse does for a missing argument, exit 2)."""
    def run(args) -> int:
        parser.print_help()
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    """The `q3tts` command's argument parser (every subcommand and flag; the docs' tests check commands with it)."""
    parser = argparse.ArgumentParser(prog="q3tts", description="Fast, faithful Qwen3-TTS inference.")
    sub = parser.add_subparsers(title="commands")

    say = sub.add_parser("say", help="synthesise text to a WAV file")
    say.add_argument("text", nargs="?", help="the text to speak ('-': read it from standard input; any length: "
                     "long texts are spoken in pieces)")
    say.add_argument("-f", "--file", type=Path, help="read the text from this file instead ('-': standard input)")
    say.add_argument("--script", type=Path, help="a dialogue instead of one text: JSON lines of turns ({\"speaker\" "
                     "or \"voice\", \"text\", \"instruct\", \"language\", \"pause\"}) or plain text with "
                     "[voice:name] tags (a voice name: a voice file beside the script, .voice optional)")
    say.add_argument("-o", "--output", default="out.wav",
                     help="audio file to write, in the format its extension names: .wav, .flac, .ogg ... "
                          "('-': a WAV file on standard output; default: out.wav)")
    say.add_argument("--play", action="store_true",
                     help="also play the audio as it is generated (needs an audio output and `pip install "
                          "'q3tts[play]'`; without them, says so and only writes the file)")
    _model_args(say)
    _lora_arg(say)
    _memory_args(say, None)
    say.add_argument("--speaker", help=f"CustomVoice preset speaker (default for CustomVoice: {DEFAULT_SPEAKER}, or a "
                     "fine-tuned checkpoint's first speaker)")
    say.add_argument("--instruct", help="style instruction (1.7B CustomVoice) or voice description (VoiceDesign)")
    say.add_argument("--language", default="auto", help="language name, or 'auto' (default)")
    say.add_argument("--voice", type=Path, help="a voice file saved by `q3tts voice create` (Base checkpoints)")
    _reference_args(say)
    text_feed = say.add_mutually_exclusive_group()
    text_feed.add_argument("--streaming-text", dest="non_streaming_mode", action="store_false", default=None,
                           help="feed the text one token per frame (default for voice cloning)")
    text_feed.add_argument("--non-streaming-text", dest="non_streaming_mode", action="store_true",
                           help="give the whole text up front (default for CustomVoice and VoiceDesign)")
    sampling = say.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    sampling.add_argument("--greedy", action="store_true", help="greedy decoding for both stages")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--subtalker-temperature", type=float)
    sampling.add_argument("--subtalker-top-k", type=int)
    sampling.add_argument("--subtalker-top-p", type=float)
    sampling.add_argument("--max-new-tokens", type=int, help="generation steps: N gives at most N-1 codec frames "
                          "(12.5 per second; the last step ends the audio)")
    sampling.add_argument("--seed", type=int, help="makes sampled output reproducible")
    say.set_defaults(run=_say)

    bench_parser = sub.add_parser("bench", help="benchmarks on the GPU")
    bench_parser.set_defaults(run=_help(bench_parser))
    bench = bench_parser.add_subparsers(title="benchmarks")
    decode = bench.add_parser("decode", help="decode speed per model and batch size (random weights, EOS off)")
    decode.add_argument("--sizes", default="0.6B-Base,1.7B-Base", help="comma-separated names from q3tts/configs")
    decode.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    decode.add_argument("--n-short", type=int, default=50)
    decode.add_argument("--n-long", type=int, default=200)
    decode.add_argument("--reps", type=int, default=2)
    decode.add_argument("--ckpt-root", type=Path, help="load <root>/<size> (e.g. the peer harness's checkpoints) "
                        "instead of drawing random weights")
    decode.add_argument("--peer-results", type=Path, nargs="*", default=[],
                        help="peer rows of the same run (shared/bench/RESULTS.md format) to print and keep beside ours")
    decode.add_argument("--fused-decode", default=None, metavar="SETTINGS",
                        help="comma-separated EngineConfig.fused_decode settings (off, attention, all), rows of each "
                             "per batch in the same run (default: the engine's default)")
    decode.add_argument("--breakdown", default="1,64", metavar="BATCHES",
                        help="batch sizes whose frame is also timed by parts in CUDA graphs (default: 1,64)")
    decode.add_argument("--out", type=Path, help="write the results JSON here")
    decode.set_defaults(run=_bench_decode)

    streaming = bench.add_parser("streaming", help="time to first audio and codec cost (random weights)")
    streaming.add_argument("--sizes", default="0.6B-Base,1.7B-Base")
    streaming.add_argument("--concurrency", default="1,16,64")
    streaming.add_argument("--reps", type=int, default=5)
    streaming.add_argument("--ckpt-root", type=Path)
    streaming.add_argument("--peer-results", type=Path, nargs="*", default=[],
                           help="the peer harness's peer_<config>.json files of the same run (streaming rows)")
    streaming.add_argument("--out", type=Path)
    streaming.set_defaults(run=_bench_streaming)

    api = bench.add_parser("api", help="every entry point (drop-in methods, synthesize, stream) on one checkpoint")
    api.add_argument("--sizes", default="0.6B-Base,1.7B-Base")
    api.add_argument("--ckpt-root", type=Path, required=True,
                     help="checkpoint folders <root>/<size> in the official layout (the peer harness builds them)")
    api.add_argument("--n-short", type=int, default=50)
    api.add_argument("--n-long", type=int, default=125, help="frames per text of the long runs (125: 10 s)")
    api.add_argument("--reps", type=int, default=2)
    api.add_argument("--peer-results", type=Path, nargs="*", default=[],
                     help="the peer harness's peer_<config>.json files of the same run")
    api.add_argument("--out", type=Path)
    api.set_defaults(run=_bench_api)

    serve = sub.add_parser("serve", help="run the HTTP server: OpenAI-compatible speech API, voices, WebSocket "
                           "text streaming, /health, /ready, /metrics (needs `pip install 'q3tts[server]'`)")
    serve.add_argument("model", help="checkpoint folder, hub id, or a built-in tiny model ('tiny', 'tiny-base', ...)")
    _lora_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    placement = serve.add_mutually_exclusive_group()
    placement.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda if available)")
    placement.add_argument("--devices", help="one engine per device behind this endpoint, requests to the least "
                           "loaded: e.g. cuda:0,cuda:1")
    placement.add_argument("--data-parallel", type=int, metavar="N", help="one engine on each of cuda:0 .. cuda:N-1")
    serve.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on the CPU)")
    serve.add_argument("--max-running", type=int, default=64, help="concurrent streams (per engine; default: 64)")
    serve.add_argument("--prefix-cache-gb", type=float, default=0.25,
                       help="memory for voice prefixes reused across requests (the talker's keys and values of "
                            "the prompt positions that depend on the voice alone; the codec's state after an "
                            "in-context voice's reference: each at most this much); 0 turns both off (default: 0.25)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="queued requests; more are refused with 429 (default: 256)")
    serve.add_argument("--max-input-chars", type=int, default=4096, help="longest input text (default: 4096)")
    _memory_args(serve, 0.9)
    serve.add_argument("--api-key", default=os.environ.get("Q3TTS_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $Q3TTS_API_KEY, else none)")
    serve.add_argument("--voices-dir", type=Path,
                       help="folder where uploaded voices persist (default: none; they last as long as the server)")
    serve.add_argument("--served-model-name", help="model id reported by /v1/models (default: MODEL)")
    serve.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                       help="another name for a voice, e.g. alloy=vivian (repeatable): a preset speaker on "
                            "CustomVoice, a description on VoiceDesign, a stored voice on Base; OpenAI's voice names "
                            "have defaults (GET /v1/audio/voices lists them)")
    serve.add_argument("--default-voice", help="the voice of a request that names none: a preset speaker "
                       "(CustomVoice), a description (VoiceDesign), or a stored voice, a saved voice file or a "
                       "recording (Base; also for OpenAI's voice names with no stored voice of that name)")
    serve.add_argument("--allow-ref-audio-urls", action="store_true",
                       help="download ref_audio given as an http(s) URL (public addresses only; default: refused)")
    serve.add_argument("--ref-audio-hosts", default="",
                       help="comma-separated hosts to download ref_audio from (only these; private addresses "
                            "allowed for them)")
    serve.add_argument("--no-runaway-guard", action="store_true",
                       help="let requests run to max_new_tokens (default: end audio beyond 20 frames per text token "
                            "+ 10 s, or 5 s of one frame repeated)")
    serve.add_argument("--max-body-bytes", type=int,
                       help="largest request body (default: room for a base64 reference recording of 25 MB)")
    serve.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds each part of a request body may take to arrive (default: 30)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds streams in flight may take to finish (default: 30)")
    serve.add_argument("--send-timeout", type=float, default=30.0,
                       help="seconds a client may stop reading a stream before it is cut (default: 30)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--single-process", action="store_true",
                       help="on a GPU, serve HTTP from the engine's own process (default: a front process does the "
                            "HTTP work and hands requests to an engine process, which lifts the capacity)")
    # an engine process behind a front (server/front/link.py), and that front's process (server/app.py)
    serve.add_argument("--core-socket", help=argparse.SUPPRESS)
    serve.add_argument("--front-pid", type=int, help=argparse.SUPPRESS)
    serve.set_defaults(run=_serve)

    batch = sub.add_parser("batch", help="render many requests from a JSON-lines file into a folder (resumable)")
    batch.add_argument("jobs", type=Path, help='one JSON object per line: {"text": ..., "speaker"/"voice"/"instruct": '
                       '..., "language", "seed", "id", sampling fields}')
    batch.add_argument("--out-dir", type=Path, required=True, help="folder for <id>.wav files and manifest.jsonl")
    _model_args(batch)
    _lora_arg(batch)
    _memory_args(batch, None)
    batch.add_argument("--max-rows", type=int, default=64, help="requests decoded together (default: 64)")
    batch.set_defaults(run=_batch)

    voice_parser = sub.add_parser("voice", help="manage cloned voices")
    voice_parser.set_defaults(run=_help(voice_parser))
    voice = voice_parser.add_subparsers(title="voice commands")
    create = voice.add_parser("create", help="clone a voice from reference audio (or a speaker embedding) and save "
                              "it")
    create.add_argument("-o", "--output", type=Path, required=True, help="voice file to write")
    _model_args(create, default="Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    _reference_args(create)
    create.add_argument("--embedding", type=Path, help="a speaker embedding instead of --ref-audio: a torch.save'd "
                        "tensor (faster-qwen3-tts's speaker.pt; any float dtype) or raw float32 values")
    create.set_defaults(run=_voice_create)
    blend = voice.add_parser("blend", help="mix x-vector voice files into a new one (the weighted mean of their "
                             "speaker embeddings)")
    blend.add_argument("voices", type=Path, nargs="+", help="voice files from `q3tts voice create` (x-vector only)")
    blend.add_argument("--weights", type=float, nargs="+", help="one weight > 0 per voice (default: equal); "
                       "normalised to sum 1")
    blend.add_argument("-o", "--output", type=Path, required=True, help="voice file to write")
    blend.set_defaults(run=_voice_blend)
    return parser


def _model_args(p: argparse.ArgumentParser, default: str = DEFAULT_MODEL) -> None:
    p.add_argument("--model", default=default,
                   help=f"checkpoint folder, hub id, or 'tiny' / 'tiny-base' / 'tiny-voice-design' (built-in random "
                        f"models that produce noise, for smoke tests) (default: {default})")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on the CPU)")


def _lora_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", help="a PEFT LoRA adapter of the talker and/or code predictor (a folder or hub id with "
                   "adapter_config.json and adapter_model.safetensors), merged into the weights at load")


def _memory_args(p: argparse.ArgumentParser, utilization_default: float | None) -> None:
    p.add_argument("--max-context", type=int,
                   help="talker positions per request, prompt + frames (default: the model's 32768)")
    p.add_argument("--kv-cache-gb", type=float,
                   help="the KV cache's size in GiB (default: see --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=utilization_default,
                   help="fraction of the GPU's memory this process may hold; the KV cache gets what the model and "
                        "its CUDA graphs leave (default: "
                        + (f"{utilization_default})" if utilization_default else "a 2 GiB KV cache)"))


def _reference_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--ref-audio", required=required, help="reference recording to clone (any format soundfile reads)")
    p.add_argument("--ref-text", help="transcript of the reference recording (needed unless --x-vector-only)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone")


def _load(args, **engine):
    from ..api.tts import TTS

    print(f"loading {args.model} ...", file=sys.stderr)
    return TTS.from_pretrained(args.model, device=args.device, dtype=args.dtype, lora=getattr(args, "lora", None),
                               **engine)


def _check_model(args, devices: list[str | None] | None = None):
    """What can be checked before the model loads: --device (or each of `devices`), --dtype, --model (its
    folder, config.json and whole safetensors files) and a local --lora folder. Returns the checkpoint's
    ModelConfig."""
    from ..api.loading import check_adapter, check_checkpoint, resolve_dtype

    flag = next((f for f, given in (("--devices", getattr(args, "devices", None)),
                                    ("--data-parallel", getattr(args, "data_parallel", None))) if given), "--device")
    for device in devices or [args.device]:
        resolved = _device(device, flag)
        try:
            resolve_dtype(args.dtype, resolved)
        except ValueError as e:
            raise ValueError(re.sub(r"^(unknown )?dtype ", r"\g<1>--dtype ", str(e))) from None
    config = check_checkpoint(args.model)
    if getattr(args, "lora", None) is not None:
        try:
            check_adapter(args.lora)
        except ValueError as e:  # ("lora x: ..." -> "--lora x: ...")
            raise ValueError(f"--{e}") from None
    return config


def _device(device: str | None, flag: str = "--device"):
    """resolve_device, its error naming `flag` ("device 'mps' is not supported" -> "--device 'mps' is ...")."""
    from ..api.loading import resolve_device

    try:
        return resolve_device(device)
    except ValueError as e:
        raise ValueError(re.sub(r"^(unknown )?device ", rf"\g<1>{flag} ", str(e))) from None


def _engine_options(args, max_rows: int) -> dict:
    """The engine's settings from the memory flags, checked before the model loads (errors name the flags)."""
    from ..engine import EngineConfig

    options = dict(max_rows=max_rows, max_context=args.max_context, kv_cache_gb=args.kv_cache_gb,
                   gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        EngineConfig(**options)
    except ValueError as e:
        raise ValueError(renamed(str(e), FLAG_NAMES)) from None
    return options


def _say(args) -> int:
    """Everything that needs no model is checked first; then the model loads and the audio streams to the file
    (and with --play to the speakers) as it is generated."""
    import numpy as np

    from ..request.builder import check_text
    from ..request.voice import Voice

    if args.script is not None:
        return _say_script(args)
    text = check_text(_read_text(args))
    output = _audio_output(args.output)
    sampling = _sampling(args)
    engine = _engine_options(args, max_rows=2)
    config = _check_model(args)
    kind = config.tts_model_type
    _check_cloning_flags(args, config)
    voice = Voice.load(args.voice) if args.voice else None
    speaker = args.speaker if args.speaker is not None else _default_speaker(config)
    _check_voice_flags(args, config, speaker, voice)
    tts = _load(args, **engine)
    if kind == "base" and voice is None:
        voice = _clone(tts, args)
    kwargs = dict(speaker=speaker, voice=voice, instruct=args.instruct, language=args.language,
                  non_streaming_mode=args.non_streaming_mode, seed=args.seed, **sampling)
    requests = tts.pieces(text, **kwargs)  # validated before anything runs
    progress = _Progress(sum(r.text_tokens for r in requests), sum(r.params.max_new_tokens for r in requests))
    player = _player(tts.sample_rate) if args.play else None
    chunks = []
    for chunk in tts.stream(text, chunk_schedule=(1,), **kwargs):
        chunks.append(chunk.pcm)
        if player is not None:
            player.write(chunk.pcm)
        progress.frame(chunk.num_frames)
    progress.close()
    if player is not None:
        player.stop()
    wav = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    _write_audio(args.output, output, wav, tts.sample_rate)
    print(f"wrote {'standard output' if output is None else args.output}: {len(wav) / tts.sample_rate:.2f} s of "
          "audio" + (f" (speaker {speaker})" if speaker else ""), file=sys.stderr)
    return 0


def _names_audio(path: Path) -> bool:
    """Whether the file name's extension names an audio format soundfile can write."""
    import soundfile as sf

    return bool(path.suffix) and sf.check_format(path.suffix[1:].upper())


def _audio_output(output: str) -> Path | None:
    """-o checked before any work: None for '-' (a WAV file on standard output, for a pipe), else the file's path,
    whose extension must name a format soundfile can write."""
    if output == "-":
        return None
    path = _output_path(output)
    if not _names_audio(path):
        raise ValueError(f"-o {output}: the file's extension names no audio format that can be written; use "
                         ".wav (or .flac, .ogg, .mp3 ...)")
    return path


def _write_audio(given: str, output: Path | None, wav, sample_rate: int) -> None:
    """The audio to `output` (None: standard output, as 16-bit WAV), a failed write one error naming -o."""
    import soundfile as sf

    try:
        if output is None:
            data = io.BytesIO()
            sf.write(data, wav, sample_rate, format="WAV", subtype="PCM_16")
            sys.stdout.buffer.write(data.getvalue())
            sys.stdout.flush()
        else:
            sf.write(output, wav, sample_rate)
    except (sf.SoundFileError, OSError) as e:  # (a full disk, a file removed or locked since the check)
        raise OSError(f"-o {given}: could not write the audio: {e}") from e


def _say_script(args) -> int:
    """`say --script`: the turns checked before the model loads what it can, all generated at once."""
    import numpy as np

    from ..request.dialogue import read_script

    if args.text is not None or args.file is not None:
        raise ValueError("--script is the whole dialogue: give no text or --file with it")
    output = _audio_output(args.output)
    sampling, engine, config = _sampling(args), _engine_options(args, max_rows=64), _check_model(args)
    try:
        turns = read_script(args.script, config.tts_model_type)
    except OSError as e:
        raise ValueError(f"--script {args.script}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--script {args.script}: not UTF-8 text ({e})") from None
    for turn in turns:
        if isinstance(turn.voice, str) and not Path(turn.voice).is_file():
            beside = args.script.parent / turn.voice
            turn.voice = beside if beside.is_file() else beside.with_name(beside.name + ".voice")
    speaker = args.speaker if args.speaker is not None else _default_speaker(config)
    tts = _load(args, **engine)
    stream = tts.stream_dialogue(turns, speaker=speaker, voice=args.voice, instruct=args.instruct,
                                 language=args.language, non_streaming_mode=args.non_streaming_mode, seed=args.seed,
                                 **sampling)
    player = _player(tts.sample_rate) if args.play else None
    frames = []
    for frame in stream:
        frames.append(frame)
        if player is not None:
            player.write(frame)
    if player is not None:
        player.stop()
    wav = np.concatenate(frames) if frames else np.zeros(0, dtype=np.float32)
    _write_audio(args.output, output, wav, tts.sample_rate)
    print(f"wrote {'standard output' if output is None else args.output}: {len(turns)} turns, "
          f"{len(wav) / tts.sample_rate:.2f} s of audio", file=sys.stderr)
    return 0


def _default_speaker(config) -> str | None:
    """`say`'s speaker without --speaker: ryan, or a fine-tuned checkpoint's first (sft_12hz.py writes its own)."""
    speakers = config.supported_speakers
    if config.tts_model_type != "custom_voice" or not speakers:
        return None
    return DEFAULT_SPEAKER if DEFAULT_SPEAKER in speakers else speakers[0]


def _sampling(args) -> dict:
    """The sampling flags given, checked (a bad number is refused before the model loads)."""
    from ..request.builder import check_max_new_tokens
    from ..sampling import SamplingParams

    if args.max_new_tokens is not None:
        check_max_new_tokens(args.max_new_tokens)
    sampling = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.greedy:
        sampling.update(do_sample=False, subtalker_dosample=False)
    SamplingParams(**sampling, seed=args.seed)
    return sampling


def _check_cloning_flags(args, config) -> None:
    """The cloning flags fit the checkpoint (the mode rule of request/rules.py, in the flags' names) and each
    other."""
    from ..request.rules import CheckpointRules

    given = [flag for flag, value in (("--ref-audio", args.ref_audio), ("--ref-text", args.ref_text),
                                      ("--x-vector-only", args.x_vector_only)) if value]
    rules = CheckpointRules(config)
    try:
        rules.check_voice_mode(bool(given or args.voice))  # (any cloning flag asks for a cloned voice)
        rules.check_voice_mode(bool(args.voice or args.ref_audio))  # (only these two give one)
    except RequestError as e:
        if e.code == "missing":
            raise ValueError("this Base checkpoint clones a voice: give --ref-audio (and --ref-text) or --voice"
                             ) from None
        kind, flags = rules.kind, " and ".join(given + ["--voice"] * bool(args.voice))
        hint = "choose a voice with --speaker" if kind == "custom_voice" else "describe the voice with --instruct"
        raise ValueError(f"{flags}: voice cloning needs a Base checkpoint; this one is {kind} ({hint})") from None
    if args.voice and given:
        raise ValueError(f"--voice is a voice already cloned: give it or {' and '.join(given)}, not both")
    _check_reference_flags(args)


def _check_reference_flags(args) -> None:
    """--ref-audio names a file (or a URL) and --ref-text comes with it unless --x-vector-only."""
    if not args.ref_audio:
        return
    if "://" not in args.ref_audio and not Path(args.ref_audio).expanduser().is_file():
        raise FileNotFoundError(f"--ref-audio {args.ref_audio}: no such file")
    if args.x_vector_only and args.ref_text:
        warnings.warn("`ref_text` is not used with `x_vector_only_mode` (the voice is the speaker embedding alone)",
                      stacklevel=2)
    elif not args.x_vector_only and not args.ref_text:
        raise ValueError("--ref-text (the reference's transcript) is needed for in-context cloning; or clone from the "
                         "speaker embedding alone with --x-vector-only")


def _check_voice_flags(args, config, speaker: str | None, voice) -> None:
    """--speaker, --instruct, --language and --voice against the checkpoint's config, before the model loads (the
    request's own checks, on the config alone)."""
    from ..request.rules import CheckpointRules

    rules = CheckpointRules(config)
    rules.check_mode(speaker, voice is not None or bool(args.ref_audio), args.instruct)
    rules.language(args.language)
    if speaker is not None:
        rules.speaker(speaker)
    if voice is not None:
        try:
            rules.voice(voice)
        except RequestError as e:  # (another model's voice, a damaged one: named by the flag and its file)
            raise ValueError(f"--voice {args.voice}: {_flag_message(e)}") from None


def _read_text(args) -> str:
    if args.file is not None:
        if args.text is not None:
            raise ValueError("give the text or --file, not both")
        try:
            return sys.stdin.read() if str(args.file) == "-" else args.file.read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--file {args.file}: {e}") from e
    if args.text is None:
        raise ValueError("give the text to speak, '-' to read it from standard input, or --file")
    return sys.stdin.read() if args.text == "-" else args.text


def _player(sample_rate: int):
    """An output stream on the default audio device, or None with a message saying why there is none."""
    try:
        import sounddevice

        stream = sounddevice.OutputStream(samplerate=sample_rate, channels=1, dtype="float32")
        stream.start()
        return stream
    except ImportError:
        reason = "the player is not installed (pip install 'q3tts[play]')"
    except Exception as e:  # PortAudio: no device, no server, no permission
        reason = f"no audio output device ({e})"
    print(f"q3tts: cannot play: {reason}; writing the file only", file=sys.stderr)
    return None


def _batch(args) -> int:
    from .batch import run

    if not args.jobs.is_file():
        raise FileNotFoundError(f"{args.jobs}: no such file")
    try:  # (before the model loads: it is read again, line by line, once it has)
        args.jobs.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{args.jobs}: not UTF-8 text ({e})") from None
    if args.out_dir.exists() and not args.out_dir.is_dir():
        raise FileExistsError(f"--out-dir {args.out_dir}: that is a file; give a folder (made if missing)")
    engine = _engine_options(args, max_rows=args.max_rows)
    _check_model(args)
    tts = _load(args, **engine)
    counts = run(tts, args.jobs, args.out_dir, window=2 * args.max_rows,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"{counts['rendered']} rendered, {counts['skipped']} already there, {counts['bad_lines']} bad lines; "
          f"manifest: {args.out_dir / 'manifest.jsonl'}", file=sys.stderr)
    return 1 if counts["bad_lines"] else 0  # (a script sees that some lines were not rendered)


def _output_path(output: str | Path) -> Path:
    """-o's path, checked before any work: its folder exists, it is not a folder itself, and it can be written
    (opened for appending, which leaves a file already there as it is; a file made here is removed again)."""
    path = Path(output)
    if path.is_dir():
        raise IsADirectoryError(f"-o {output}: that is a folder; give a file name")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"-o {output}: the folder {str(path.parent)!r} does not exist")
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise type(e)(f"-o {output}: cannot write there ({e.strerror or e})") from None
    if not existed:
        path.unlink()
    return path


def _voice_output(output: Path) -> Path:
    """A voice command's -o, checked before any work (as `_output_path`): a name with an audio extension is refused,
    since what is written there is no audio and a player would fail on it."""
    if _names_audio(output):
        raise ValueError(f"-o {output}: a voice file is not audio (it holds the voice's speaker embedding and "
                         f"reference codes, for --voice); name it e.g. {output.with_suffix('.voice')}")
    return _output_path(output)


def _voice_create(args) -> int:
    from ..request.voice import size_name

    _voice_output(args.output)
    config = _check_model(args)
    if config.tts_model_type != "base":
        raise ValueError(f"voice cloning needs a Base checkpoint; {args.model} is {config.tts_model_type}")
    if (args.embedding is None) == (args.ref_audio is None):
        raise ValueError("give --ref-audio (a recording to clone) or --embedding (a speaker embedding file), one of "
                         "them")
    if args.embedding is not None:
        return _voice_from_embedding(args, config)
    _check_reference_flags(args)
    tts = _load(args)
    voice = _clone(tts, args)
    voice.save(args.output)
    mode = "x-vector only" if voice.x_vector_only_mode else f"in-context, {voice.ref_code.shape[0]} reference frames"
    print(f"wrote {args.output} ({mode}, {size_name(tts.config.tts_model_size)})", file=sys.stderr)
    return 0


def _clone(tts, args):
    """The voice of --ref-audio; a recording that cannot be used is an error naming --ref-audio (and the file)."""
    from ..errors import AudioError

    try:
        return tts.create_voice(args.ref_audio, args.ref_text, args.x_vector_only)
    except AudioError as e:
        message = _flag_message(e)
        prefix = "--ref-audio " if message.startswith(args.ref_audio) else f"--ref-audio {args.ref_audio}: "
        raise ValueError(prefix + message) from None


def _voice_from_embedding(args, config) -> int:
    """`voice create --embedding`: no model to load, the embedding's size checked against the checkpoint's."""
    from ..request.voice import Voice, size_name

    if args.ref_text or args.x_vector_only:
        raise ValueError("--ref-text and --x-vector-only go with --ref-audio; a voice from --embedding is the "
                         "speaker embedding alone")
    voice = Voice.from_embedding(args.embedding, config.tts_model_size)
    size, hidden = voice.ref_spk_embedding.numel(), config.talker_config.hidden_size
    if size != hidden:
        raise ValueError(f"--embedding {args.embedding}: {size} values; the speaker embeddings of this "
                         f"{size_name(config.tts_model_size)} checkpoint have {hidden}")
    voice.save(args.output)
    print(f"wrote {args.output} (x-vector only, {size_name(config.tts_model_size)})", file=sys.stderr)
    return 0


def _voice_blend(args) -> int:
    from ..request.voice import Voice

    _voice_output(args.output)
    weights = args.weights or [1.0] * len(args.voices)
    if len(weights) != len(args.voices):
        raise ValueError(f"--weights: {len(weights)} weights for {len(args.voices)} voices; give one per voice")
    try:
        voice = Voice.blend(list(zip(args.voices, weights)))
    except RequestError as e:
        raise ValueError(e.message.replace("voices: ", "", 1).replace("the weight of", "--weights: the weight of")
                         ) from None
    voice.save(args.output)
    shares = ", ".join(f"{path.name} {w / sum(weights):.3g}" for path, w in zip(args.voices, weights))
    print(f"wrote {args.output} (x-vector only: {shares})", file=sys.stderr)
    return 0


def _serve(args) -> int:
    try:
        from ..server import ServerConfig, serve
    except ImportError as e:
        print(f"q3tts: error: the server needs its extra packages: pip install 'q3tts[server]' ({e})", file=sys.stderr)
        return 1
    from ..server.voice_aliases import VoiceAliases, parse_aliases

    try:
        config = ServerConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                              max_running=args.max_running, max_waiting=args.max_waiting,
                              max_input_chars=args.max_input_chars, max_context=args.max_context,
                              kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                              prefix_cache_gb=args.prefix_cache_gb, api_key=args.api_key or None,
                              voices_dir=args.voices_dir, core_socket=args.core_socket, front_pid=args.front_pid,
                              served_model_name=args.served_model_name, allow_ref_audio_urls=args.allow_ref_audio_urls,
                              voice_aliases=parse_aliases(args.voice_alias), default_voice=args.default_voice,
                              ref_audio_hosts=tuple(h for h in args.ref_audio_hosts.split(",") if h),
                              send_timeout_s=args.send_timeout, drain_timeout_s=args.drain_timeout,
                              body_timeout_s=args.body_timeout, max_body_bytes=args.max_body_bytes,
                              lora=args.lora, **({"runaway_guard": None} if args.no_runaway_guard else {}))
    except ValueError as e:  # (the settings' names in its message -> this command's flags)
        raise ValueError(_serve_flags(str(e))) from None
    devices = engine_devices(args)
    model = _check_model(args, devices)  # (the engine starts in the server, where a failure would be a traceback)
    try:  # (what the aliases and the default voice name, against the checkpoint's speakers)
        VoiceAliases.for_checkpoint(model.tts_model_type, model.supported_speakers, config.voice_aliases,
                                    config.default_voice)
    except ValueError as e:
        raise ValueError(_serve_flags(str(e))) from None
    if devices:
        from ..server.front.app import serve_devices

        serve_devices(config, devices, log_level=args.log_level)
    else:
        serve(config, log_level=args.log_level)
    return 0


def _serve_flags(message: str) -> str:
    """A server setting's message in `serve`'s flags, also a bare leading name ("port must be ..." -> "--port must
    be ...": `renamed` takes only names with an underscore)."""
    message = renamed(message, SERVE_FLAG_NAMES)
    first = message.split(" ", 1)[0]
    return SERVE_FLAG_NAMES[first] + message[len(first):] if first in SERVE_FLAG_NAMES else message


def engine_devices(args) -> list[str]:
    """The devices of the engine processes behind a front: those of `--devices` / `--data-parallel` (ValueError if
    they make no sense), else one GPU's (a front and one engine process: server/front/link.py), else [] (one process:
    `--single-process`, the CPU, or an engine process of a front)."""
    if args.single_process:
        if args.devices is not None or args.data_parallel is not None:
            raise ValueError("--single-process serves one device from one process: it does not go with --devices "
                             "or --data-parallel")
        return []
    if args.devices is None and args.data_parallel is None:
        on_gpu = args.core_socket is None and _device(args.device).type == "cuda"
        return [args.device or "cuda"] if on_gpu else []
    if args.data_parallel is not None:
        if args.data_parallel < 1:
            raise ValueError(f"--data-parallel needs N >= 1, got {args.data_parallel}")
        return [f"cuda:{i}" for i in range(args.data_parallel)]
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices:
        raise ValueError("--devices needs a comma-separated list, e.g. cuda:0,cuda:1")
    for device in devices:
        if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
            raise ValueError(f"--devices: {quote(device)} is not a device (cpu, cuda:N)")
    cuda = [d for d in devices if d != "cpu"]
    if len(set(cuda)) < len(cuda):
        raise ValueError(f"--devices names a GPU twice ({args.devices}): one engine per GPU")
    return devices


def _bench_decode(args) -> int:
    import json

    from ..benchmarks.common import write_results
    from ..benchmarks.decode import bench_decode, side_by_side
    from ..engine import EngineConfig

    fused = tuple(args.fused_decode.split(",")) if args.fused_decode else (EngineConfig.fused_decode,)
    for setting in fused:
        EngineConfig(fused_decode=setting)  # a bad setting is refused before any model loads
    rows = bench_decode(args.sizes.split(","), [int(b) for b in args.batches.split(",")], args.n_short, args.n_long,
                        args.reps, args.ckpt_root, tuple(int(b) for b in args.breakdown.split(",")), fused=fused,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    peers = [r for path in args.peer_results for r in json.loads(path.read_text())["results"]]
    command = "q3tts " + " ".join(sys.argv[1:])
    doc = write_results(rows, args.out, command, peers) if args.out else {"results": [vars(r) for r in rows]}
    print(side_by_side(doc["results"]))
    return 0


def _bench_streaming(args) -> int:
    import json

    from ..benchmarks.common import write_results
    from ..benchmarks.streaming import bench_streaming, codec_precision, peer_streaming_rows

    log = lambda m: print(m, file=sys.stderr, flush=True)
    sizes = args.sizes.split(",")
    rows = bench_streaming(sizes, args.ckpt_root, tuple(int(b) for b in args.concurrency.split(",")), args.reps,
                           log=log)
    precision = codec_precision()
    log(f"codec bf16 vs fp32: {precision}")
    peers = peer_streaming_rows(args.peer_results)
    for row in rows:
        row["codec_bf16_vs_fp32"] = precision
    if args.out:
        write_results(rows, args.out, "q3tts " + " ".join(sys.argv[1:]), peers)
    for row in rows + peers:
        print(json.dumps({k: row.get(k) for k in ("engine", "model", "batch", "ttfa_ms_p50", "ttfa_ms_p95",
                                                   "codec_share_of_lm", "step_ms_codec_overlapped",
                                                   "step_ms_codec_sequential")}))
    return 0


def _bench_api(args) -> int:
    from ..benchmarks.api import bench_api, peer_api_rows, table
    from ..benchmarks.common import write_results

    rows = bench_api(args.sizes.split(","), args.ckpt_root, args.n_short, args.n_long, args.reps,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    peers = peer_api_rows(args.peer_results)
    if args.out:
        write_results(rows, args.out, "q3tts " + " ".join(sys.argv[1:]), peers)
    print(table(rows + peers))
    return 0


class _Progress:
    """Progress on stderr: frames, audio seconds and speed, against the length the text usually takes (~3.5
    frames per text token; the model decides when it ends). Redrawn in place on a terminal, a line every few
    seconds otherwise."""

    FRAMES_PER_TOKEN = 3.5

    def __init__(self, text_tokens: int, max_frames: int):
        self.expected = min(max(1, round(text_tokens * self.FRAMES_PER_TOKEN)), max_frames)
        self.frames, self.start, self.last = 0, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()

    def frame(self, count: int = 1) -> None:
        self.frames += count
        now = time.perf_counter()
        if now - self.last >= (0.25 if self.tty else 5.0) and now - self.start > 1.0:
            self.last = now
            self._show(now)

    def _show(self, now: float) -> None:
        audio, elapsed = self.frames * 0.08, now - self.start
        line = (f"{audio:.1f} s of audio (~{self.expected * 0.08:.0f} s expected), {self.frames} frames, "
                f"{audio / elapsed:.1f}x real time")
        print(f"\r{line}   " if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.last:
            self._show(time.perf_counter())
            if self.tty:
                print(file=sys.stderr)


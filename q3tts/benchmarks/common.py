"""What the benchmarks share: the model and prompt they run, graph-replay timing, the results file."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch

from ..checkpoint import instantiate
from ..config import ModelConfig, SpeechTokenizerConfig
from ..models.codec_decoder import CodecDecoder
from ..models.qwen3_tts import Qwen3TTSModel
from ..request.prompt import PromptSpec, build_prompt
from ..tiny.random_init import random_state_dict
from ..tiny.speech_tokenizer import condition_vocoder
from .random_model import CONFIG_DIR, random_model, random_prompt_ids

FRAME_SECONDS = 0.08  # one codec frame = 80 ms of audio


def cuda_device(command: str) -> torch.device:
    """The GPU a benchmark runs on; a clear error (the CLI prints it) where none is visible."""
    if not torch.cuda.is_available():
        raise ValueError(f"{command} needs a CUDA GPU and none is visible here (torch {torch.__version__})")
    return torch.device("cuda")


def load_model(name: str, ckpt_root: Path | None, device: torch.device) -> Qwen3TTSModel:
    """bf16 model with EOS disabled: from `ckpt_root/name` if given, else random weights at the real config."""
    if ckpt_root is None:
        return random_model(name, device=device, dtype=torch.bfloat16, disable_eos=True)
    folder = Path(ckpt_root) / name
    model = Qwen3TTSModel.from_folder(folder, ModelConfig.from_file(folder / "config.json"), device, torch.bfloat16)
    model.talker.codec_head.weight.data[model.config.talker_config.codec_eos_token_id] = 0
    return model


def clone_prompt(model: Qwen3TTSModel, num_text_tokens: int = 30, seed: int = 0, non_streaming: bool = False):
    """An x-vector voice-clone prompt (random text ids and speaker embedding from `seed`), English; with
    `non_streaming` the whole text is in the prefill."""
    return voice_prompt(model, num_text_tokens, seed, non_streaming)[0]


def voice_prompt(model: Qwen3TTSModel, num_text_tokens: int = 30, seed: int = 0, non_streaming: bool = False,
                 ref_seconds: float = 0.0, text_seed: int | None = None):
    """(prompt, reference codes or None) of `voice_spec`'s request."""
    spec = voice_spec(model, num_text_tokens, seed, non_streaming, ref_seconds, text_seed)
    return build_prompt(model.talker, model.config, spec), spec.ref_codes


def voice_spec(model: Qwen3TTSModel, num_text_tokens: int = 30, seed: int = 0, non_streaming: bool = False,
               ref_seconds: float = 0.0, text_seed: int | None = None) -> PromptSpec:
    """A voice-clone request, English, the voice from `seed` (a random speaker embedding; with `ref_seconds` an
    in-context voice: random reference frames and a transcript of ~3.5 tokens per second), the text from
    `text_seed` (default `seed`)."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    ref_codes = ref_ids = None
    if ref_seconds:
        ref_codes = torch.randint(0, 2048, (round(ref_seconds / FRAME_SECONDS), 16), generator=g)
        ref_ids = random_prompt_ids(config, max(1, round(3.5 * ref_seconds)), seed=seed + 7919)[:-3]
    text = random_prompt_ids(config, num_text_tokens, seed=seed if text_seed is None else text_seed)
    return PromptSpec(input_ids=text, language="english", non_streaming_mode=non_streaming,
                      speaker_embedding=torch.randn(config.talker_config.hidden_size, generator=g),
                      ref_ids=ref_ids, ref_codes=ref_codes)


def add_ab_options(parser) -> None:
    """--set and --label, for A/B runs of one tree against itself or another (bench/frame_parts.py,
    bench/sampling.py); `ab_label` applies them."""
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a q3tts module's constant for this run (a Python literal), e.g. "
                             "kernels.sampler.SAMPLE_WARPS=4")
    parser.add_argument("--label", default=None, help="first word of each line (default: the tree's q3tts path)")


def ab_label(args) -> str:
    """Sets each --set MODULE.NAME=VALUE (a q3tts module's constant, MODULE dotted below q3tts) for the run;
    returns the label of its lines: --label, or the folder q3tts was imported from."""
    for setting in args.set:
        name, value = setting.split("=", 1)
        module, attr = name.rsplit(".", 1)
        setattr(importlib.import_module(f"q3tts.{module}"), attr, ast.literal_eval(value))
    return args.label or str(Path(__file__).resolve().parents[2])


def graph_ms(fn, replays: int, reps: int = 1) -> float:
    """GPU ms per call of `fn`: `reps` calls captured in one CUDA graph, replayed `replays` times (a Python launch,
    ~20-40 us, would otherwise hide any kernel shorter than itself)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * reps)


def write_results(rows: list, path: Path, command: str, extra_rows: list[dict] | None = None) -> dict:
    """One JSON file in the shared/bench/RESULTS.md format (ours first, then any peer rows of the same run)."""
    # The GPU machine gets a copy of the working tree without .git: the caller passes the commit there.
    commit = os.environ.get("Q3TTS_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"card": card, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "commit": commit or None, "command": command,
           "env": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "results": [asdict(r) if is_dataclass(r) else r for r in rows] + (extra_rows or [])}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return doc


def random_decoder(device: torch.device, dtype: torch.dtype):
    """The full-size codec decoder with random weights, conditioned as the tiny checkpoints are (each
    upsampling block rescaled to unit output, the waveform peaking at 0.5), so that its audio is not clipped
    noise and precision comparisons mean something."""
    config = SpeechTokenizerConfig.from_file(CONFIG_DIR / "speech_tokenizer.json")
    with torch.device("meta"):
        shapes = {"decoder." + k: tuple(v.shape) for k, v in CodecDecoder(config.decoder_config).state_dict().items()}
    tensors = random_state_dict(shapes, 0, device)
    condition_vocoder(tensors, config, 0)
    tensors = {k.removeprefix("decoder."): v.to(dtype) for k, v in tensors.items()}
    return instantiate(lambda: CodecDecoder(config.decoder_config), tensors, device).eval()

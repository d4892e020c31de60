"""How far the engine's float32 audio is from the official decode, and why: CPU, tiny checkpoints of shapes drawn
within the official families (`TinyShape.random`), every mode (docs/faithfulness.md, "Audio: how close two
float32 decodes can be").

Per item: max |engine - reference| (the reference path's audio is bit-identical to the official at equal thread
counts: tests/equivalence/test_equivalence.py), and both against the exact audio, the same codes decoded in float64.
Prints a row per item and a summary (engine error / official error; engine-vs-official / official error), writes JSON.

usage: python bench/audio_fidelity.py [--seeds 0-8] [--condition last] [--out audio-fidelity.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import warnings
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from q3tts import TTS
from q3tts.tiny import write_tiny_checkpoint
from q3tts.tiny.shapes import TinyShape

GREEDY = {"do_sample": False, "subtalker_dosample": False}


def voice_like(seconds: float, sr: int, seed: int) -> np.ndarray:
    """A gliding harmonic tone under a syllable envelope, plus noise (peak ~0.5)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 2.5 * t)) / sr
    tone = sum(np.sin(k * phase + rng.random() * 6) / k for k in range(1, 10))
    return (0.15 * tone * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2) + 0.02 * rng.standard_normal(t.size)
            ).astype(np.float32)


def calls(kind: str, audio: dict[str, str]) -> list[tuple[str, dict]]:
    if kind == "base":
        return [("generate_voice_clone", dict(text="Hello world, a test.", ref_audio=audio["stereo44k"],
                                              ref_text="Good morning to you.", repetition_penalty=1.3,
                                              max_new_tokens=14)),
                ("generate_voice_clone", dict(text=["Hi.", "One two three four."],
                                              ref_audio=[audio["mono24k"], audio["stereo44k"]],
                                              ref_text=["Hello there.", "A lazy dog."], non_streaming_mode=True,
                                              max_new_tokens=12)),
                ("generate_voice_clone", dict(text="你好世界", ref_audio=audio["mono24k"], x_vector_only_mode=True,
                                              max_new_tokens=10))]
    if kind == "custom_voice":
        return [("generate_custom_voice", dict(text="The quick brown fox.", speaker="ryan", instruct="slowly",
                                               max_new_tokens=12)),
                ("generate_custom_voice", dict(text=["Hello.", "Good morning, seven bright stars.", "Thanks."],
                                               speaker=["ryan", "eric", None], language=["english", "auto", "chinese"],
                                               repetition_penalty=1.2, max_new_tokens=16))]
    return [("generate_voice_design", dict(text=["One two.", "Numbers 42."], instruct=["A calm man.", ""],
                                           non_streaming_mode=False, max_new_tokens=12))]


def full_codes(engine: TTS, method: str, kw: dict, b: int, codes: torch.Tensor) -> torch.Tensor:
    """Item b's codes as decoded: an in-context voice's reference codes in front of the generated ones."""
    if method != "generate_voice_clone" or kw.get("x_vector_only_mode"):
        return codes
    pick = lambda v: v[b] if isinstance(v, list) else v
    voice = engine.create_voice_clone_prompt(pick(kw["ref_audio"]), pick(kw["ref_text"]))[0]
    return torch.cat([voice.ref_code, codes])


def engine_call(engine: TTS, method: str, kw: dict) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """The drop-in call on the engine: its audio, and each item's generated codes (from the engine's streams)."""
    streams, submit = [], TTS.submit

    def recording(self, *args, **kwargs):
        streams.append(submit(self, *args, **kwargs))
        return streams[-1]

    TTS.submit = recording
    try:
        wavs, _ = getattr(engine, method)(**kw, **GREEDY)
    finally:
        TTS.submit = submit
    return wavs, [torch.from_numpy(np.stack(s.channel.codes)) for s in streams]


def measure(folder: Path, kind: str, audio: dict[str, str]) -> list[dict]:
    engine = TTS.from_pretrained(folder, device_map="cpu", dtype=torch.float32)
    reference = TTS.from_pretrained(folder, device_map="cpu", dtype=torch.float32, reference=True)
    exact_decoder = copy.deepcopy(reference.speech_tokenizer.decoder).double()
    rows = []
    for c, (method, kw) in enumerate(calls(kind, audio)):
        ours, generated = engine_call(engine, method, kw)
        official, _ = getattr(reference, method)(**kw, **GREEDY)
        for b, (e, o, g) in enumerate(zip(ours, official, generated)):
            codes = full_codes(engine, method, kw, b, g)
            with torch.no_grad():
                x = exact_decoder(codes.T[None])[0, 0].numpy()[-len(o):]
            d = lambda p, q: float(np.abs(p - q).max())
            rows.append({"kind": kind, "call": c, "item": b, "engine_vs_official": d(e, o), "engine_error": d(e, x),
                         "official_error": d(o, x)})
    engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-8", help="shape seeds, a range a-b")
    ap.add_argument("--condition", default="last", choices=["last", "blocks"])
    ap.add_argument("--out", type=Path, default=Path("audio-fidelity.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    lo, hi = map(int, args.seeds.split("-"))
    tmp = Path(tempfile.mkdtemp())
    audio = {"stereo44k": str(tmp / "stereo44k.wav"), "mono24k": str(tmp / "mono24k.wav")}
    sf.write(audio["stereo44k"], np.stack([voice_like(1.3, 44100, 5), voice_like(1.3, 44100, 6)], 1), 44100)
    sf.write(audio["mono24k"], voice_like(0.7, 24000, 2), 24000)
    rows = []
    for seed in range(lo, hi + 1):
        for size in ("0b6", "1b7"):
            shape = TinyShape.random(seed, size, args.condition)
            for kind in ("base", "custom_voice") + (("voice_design",) if size == "1b7" else ()):
                folder = write_tiny_checkpoint(tmp / f"{seed}-{size}-{kind}", kind, size, seed=seed, shape=shape)
                for row in measure(folder, kind, audio):
                    rows.append({"seed": seed, "size": size, **row})
                    print(f"{seed} {size} {kind:12s} call {row['call']} item {row['item']}: engine vs official "
                          f"{row['engine_vs_official']:.2e}, errors vs float64: engine {row['engine_error']:.2e}, "
                          f"official {row['official_error']:.2e}", flush=True)
    ratio = np.array([r["engine_error"] / r["official_error"] for r in rows])
    spread = np.array([r["engine_vs_official"] / r["official_error"] for r in rows])
    summary = {"items": len(rows), "threads": torch.get_num_threads(), "condition": args.condition,
               "engine_error_over_official_error": [float(ratio.min()), float(np.median(ratio)), float(ratio.max())],
               "engine_vs_official_over_official_error": [float(spread.min()), float(np.median(spread)),
                                                          float(spread.max())],
               "official_error_range": [min(r["official_error"] for r in rows),
                                        max(r["official_error"] for r in rows)],
               "engine_vs_official_max": max(r["engine_vs_official"] for r in rows),
               "items_over_1e-5": sum(r["engine_vs_official"] > 1e-5 for r in rows)}
    print(json.dumps(summary, indent=1))
    args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

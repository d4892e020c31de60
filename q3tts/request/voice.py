"""A cloned voice: the speaker embedding, and for in-context cloning the reference codes and transcript.

Created once from reference audio (`TTS.create_voice`), saved to a file and loaded again without the audio.
The field names are those of the official `VoiceClonePromptItem`, which is an alias of this class.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from ..config import ModelConfig
from ..errors import RequestError, RequestTypeError, quote
from ..models.speaker_encoder import compute_speaker_embedding
from .audio import AudioError, load_audio, resample
from .embedding import embedding_tensor, read_embedding
from .voice_blend import mixed_embedding

FORMAT = "q3tts.voice.v1"
HOW_TO_MAKE = ("; a voice file comes from Voice.save or `q3tts voice create` (a recording is cloned from ref_audio "
               "instead)")
META_TYPES = {"x_vector_only_mode": bool, "icl_mode": bool, "ref_text": (str, type(None)),
              "model_size": (str, type(None))}  # a voice file's metadata (absent: None)
SIZE_NAMES = {"0b6": "0.6B", "1b7": "1.7B"}  # config.json's tts_model_size -> what users call the model


def size_name(model_size: str) -> str:
    return SIZE_NAMES.get(model_size, model_size)


@dataclass(eq=False)  # (identity: voices are dict keys of a blend; tensors have no == of one truth value)
class Voice:
    ref_code: torch.Tensor | None  # [T, 16] int64 reference codes (ICL), None in x-vector-only mode
    ref_spk_embedding: torch.Tensor  # [hidden] speaker embedding (x-vector)
    x_vector_only_mode: bool
    icl_mode: bool
    ref_text: str | None = None
    model_size: str | None = None  # "0b6" / "1b7": the checkpoint family the embedding belongs to

    @classmethod
    def from_embedding(cls, embedding: Any, model_size: str | None = None) -> Voice:
        """A voice in x-vector-only mode from a speaker embedding computed elsewhere: a float tensor, array or list
        [hidden] (any float dtype, bf16 included), or the path of a file (`torch.save`d tensor or raw float32).
        Its size must be the checkpoint's hidden size (1,024 for 0.6B, 2,048 for 1.7B), checked when it is used;
        `model_size` ("0b6" / "1b7"), if given, is checked too. RequestError (param "embedding") if it is not a
        finite float vector."""
        vector = read_embedding(embedding) if isinstance(embedding, (str, Path)) else embedding_tensor(embedding)
        if model_size is not None and model_size not in SIZE_NAMES:
            raise RequestError(f"model_size must be one of {sorted(SIZE_NAMES)}, got {quote(model_size)}",
                               "model_size")
        return cls(ref_code=None, ref_spk_embedding=vector, x_vector_only_mode=True, icl_mode=False,
                   model_size=model_size)

    @classmethod
    def blend(cls, voices: Mapping[Voice | str | Path, float] | Iterable[tuple[Voice | str | Path, float]]) -> Voice:
        """A new x-vector voice, the weighted mean of x-vector voices' speaker embeddings ({voice: weight}; a voice
        is a Voice or a voice file's path; weights > 0, normalised to sum 1; voice_blend.py says how the mix is
        formed). RequestError (param "voices"): no voices, a bad weight, an in-context voice (its recording's
        codes and transcript cannot be mixed), voices of different model sizes."""
        named = []
        items = list(voices.items() if isinstance(voices, Mapping) else voices) \
            if isinstance(voices, Iterable) and not isinstance(voices, (str, Path, Voice)) else None
        if items is None or not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
            raise RequestTypeError("voices: a blend takes {voice: weight} or (voice, weight) pairs, got "
                                   f"{quote(voices)}", "voices")
        for i, (voice, weight) in enumerate(items):
            if isinstance(voice, (str, Path)):
                named.append((quote(str(voice)), cls.load(voice), weight))
            elif isinstance(voice, Voice):
                named.append((f"voice {i}", voice, weight))
            else:
                raise RequestTypeError(f"voices: expected a Voice or a voice file's path, got {type(voice).__name__}",
                                       "voices")
        return cls.from_embedding(*mixed_embedding(named, "voices"))

    def save(self, path: str | Path) -> None:
        """Writes the voice to `path` (a safetensors file); OSError naming `path` if it cannot be written."""
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"{path}: cannot save the voice: the folder {str(path.parent)!r} does not exist")
        tensors = {"ref_spk_embedding": self.ref_spk_embedding.detach().float().cpu().contiguous()}
        if self.ref_code is not None:
            tensors["ref_code"] = self.ref_code.detach().long().cpu().contiguous()
        meta = {"format": FORMAT, "x_vector_only_mode": self.x_vector_only_mode, "icl_mode": self.icl_mode,
                "ref_text": self.ref_text, "model_size": self.model_size}
        data = save(tensors, metadata={"q3tts": json.dumps(meta)})  # (in memory: a voice is kilobytes)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:  # whole or not at all: a reader never sees half a file
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise type(e)(f"{path}: cannot save the voice: {e.strerror or e}") from e

    @classmethod
    def load(cls, path: str | Path) -> Voice:
        """Reads a voice file written by `save`; RequestError (param "voice") if it is missing or not one."""
        path = Path(path)
        if not path.is_file():
            raise RequestError(f"{path}: voice file not found{HOW_TO_MAKE}", "voice", code="not_found")
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("q3tts", "{}"))
        except (SafetensorError, json.JSONDecodeError, OSError) as e:
            raise RequestError(f"{path}: not a q3tts voice file ({e}){HOW_TO_MAKE}", "voice") from e
        version = meta.get("format") if isinstance(meta, dict) else None
        if isinstance(version, str) and version.startswith("q3tts.voice.") and version != FORMAT:
            raise RequestError(f"{path}: a voice file of an unsupported version ({version}; this q3tts reads "
                               f"{FORMAT}): save it again with this version", "voice")
        if version != FORMAT or "ref_spk_embedding" not in tensors:
            raise RequestError(f"{path}: not a q3tts voice file (format {version!r}){HOW_TO_MAKE}", "voice")
        garbled = [k for k, kinds in META_TYPES.items() if not isinstance(meta.get(k), kinds)]
        if garbled:
            raise RequestError(f"{path}: a damaged voice file (its metadata lacks or garbles {', '.join(garbled)})"
                               f"{HOW_TO_MAKE}", "voice")
        return cls(ref_code=tensors.get("ref_code"), ref_spk_embedding=tensors["ref_spk_embedding"],
                   x_vector_only_mode=meta["x_vector_only_mode"], icl_mode=meta["icl_mode"],
                   ref_text=meta.get("ref_text"), model_size=meta.get("model_size"))


VoiceClonePromptItem = Voice


def clone_voices(speech_tokenizer, speaker_encoder, config: ModelConfig, ref_audio: list[Any],
                 ref_texts: list[str | None], x_vector_only: list[bool]) -> list[Voice]:
    """Voices from reference recordings (path, URL, bytes, base64, or (array, sample_rate)), as the official
    `create_voice_clone_prompt` makes them: the speaker embedding, and for in-context cloning the reference
    codes and transcript."""
    for i, (text, xvec) in enumerate(zip(ref_texts, x_vector_only)):
        if text is not None and not isinstance(text, str):
            raise RequestTypeError(f"ref_text must be a string (the reference's transcript), got {quote(text)}",
                                   "ref_text")
        if not xvec and (text is None or not str(text).strip()):
            which = f"; missing for reference {i}" if len(ref_texts) > 1 else ""
            raise RequestError(f"ref_text is required for in-context voice cloning (x_vector_only_mode=False){which}",
                               "ref_text")
    loaded = [load_audio(a) for a in ref_audio]
    rate = speech_tokenizer.sample_rate
    # The official code encodes same-rate references as one padded batch (which can change the last reference
    # frame of shorter items) and mixed rates one by one; so do we.
    if len({sr for _, sr in loaded}) == 1:
        codes = speech_tokenizer.encode([resample(w, sr, rate) for w, sr in loaded])
    else:
        codes = [speech_tokenizer.encode([resample(w, sr, rate)])[0] for w, sr in loaded]
    encoder_rate = config.speaker_encoder_config.sample_rate
    embeddings = [compute_speaker_embedding(speaker_encoder, resample(w, sr, encoder_rate)) for w, sr in loaded]
    for i, embedding in enumerate(embeddings):
        if not bool(torch.isfinite(embedding).all()):  # (samples far beyond +-1 overflow the mel spectrogram)
            which = f" {i}" if len(loaded) > 1 else ""
            raise AudioError(f"reference audio{which} gives a speaker embedding with NaN or infinite values: its "
                             f"samples reach {float(abs(loaded[i][0]).max()):.3g} (audio is expected within +-1)")
    return [Voice(ref_code=None if xvec else c, icl_mode=not xvec, x_vector_only_mode=bool(xvec), ref_text=text,
                  ref_spk_embedding=embedding, model_size=config.tts_model_size)
            for c, text, xvec, embedding in zip(codes, ref_texts, x_vector_only, embeddings)]

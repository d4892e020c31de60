"""A cloned voice: the speaker embedding, and for in-context cloning the reference codes and transcript.

Created once from reference audio (`TTS.create_voice`), saved to a file and loaded again without the audio.
The field names are those of the official `VoiceClonePromptItem`, which is an alias of this class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT = "q3tts.voice.v1"


@dataclass
class Voice:
    ref_code: torch.Tensor | None  # [T, 16] int64 reference codes (ICL), None in x-vector-only mode
    ref_spk_embedding: torch.Tensor  # [hidden] speaker embedding (x-vector)
    x_vector_only_mode: bool
    icl_mode: bool
    ref_text: str | None = None
    model_size: str | None = None  # "0b6" / "1b7": the checkpoint family the embedding belongs to

    def save(self, path: str | Path) -> None:
        tensors = {"ref_spk_embedding": self.ref_spk_embedding.detach().float().cpu().contiguous()}
        if self.ref_code is not None:
            tensors["ref_code"] = self.ref_code.detach().long().cpu().contiguous()
        meta = {"format": FORMAT, "x_vector_only_mode": self.x_vector_only_mode, "icl_mode": self.icl_mode,
                "ref_text": self.ref_text, "model_size": self.model_size}
        save_file(tensors, str(path), metadata={"q3tts": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> Voice:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: voice file not found")
        try:
            tensors = load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("q3tts", "{}"))
        except (SafetensorError, json.JSONDecodeError, OSError) as e:
            raise ValueError(f"{path}: not a q3tts voice file ({e})") from e
        if meta.get("format") != FORMAT or "ref_spk_embedding" not in tensors:
            raise ValueError(f"{path}: not a q3tts voice file (format {meta.get('format')!r})")
        return cls(ref_code=tensors.get("ref_code"), ref_spk_embedding=tensors["ref_spk_embedding"],
                   x_vector_only_mode=bool(meta["x_vector_only_mode"]), icl_mode=bool(meta["icl_mode"]),
                   ref_text=meta.get("ref_text"), model_size=meta.get("model_size"))


VoiceClonePromptItem = Voice

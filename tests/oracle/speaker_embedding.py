"""Official speaker embeddings: official Qwen3TTSSpeakerEncoder + official extract_speaker_embedding.

usage: speaker_embedding.py DIR. DIR/cases.json holds a list of {"config": {...}, "weights": FILE (safetensors
with the checkpoint's names minus `speaker_encoder.`), "wavs": [NPY, ...]}; wavs are 24 kHz mono float32 or,
for {"wav": NPY, "sr": SR} entries, any rate (resampled as create_voice_clone_prompt does). The embeddings go to
DIR/out.npz as emb_{case}_{wav}. Loading with strict=True also proves the parameter names and shapes match.
"""

import json
import sys
import types
from pathlib import Path

import librosa
import numpy as np
import torch
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration, Qwen3TTSSpeakerEncoder
from safetensors.torch import load_file


def build_encoder(config: dict, weights: Path) -> Qwen3TTSSpeakerEncoder:
    encoder = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**config)).eval()
    encoder.load_state_dict(load_file(str(weights)), strict=True)
    return encoder


def main(root: Path) -> None:
    torch.set_num_threads(2)
    out = {}
    for c, case in enumerate(json.loads((root / "cases.json").read_text())):
        encoder = build_encoder(case["config"], root / case["weights"])
        # extract_speaker_embedding reads only these attributes of the full model.
        model = types.SimpleNamespace(speaker_encoder=encoder, device=torch.device("cpu"), dtype=torch.float32)
        for w, item in enumerate(case["wavs"]):
            if isinstance(item, dict):
                wav, sr = np.load(root / item["wav"]).astype(np.float32), item["sr"]
                if sr != 24000:
                    wav = librosa.resample(y=wav, orig_sr=int(sr), target_sr=24000)
            else:
                wav = np.load(root / item)
            emb = Qwen3TTSForConditionalGeneration.extract_speaker_embedding(model, wav, 24000)
            out[f"emb_{c}_{w}"] = emb.float().numpy()
    np.savez(root / "out.npz", **out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

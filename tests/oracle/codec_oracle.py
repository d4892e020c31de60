"""Official speech tokenizer (qwen_tts 0.1.1) results for tests/test_codec.py. Imports only official code.

usage: codec_oracle.py TOKENIZER_DIR WORK_DIR

WORK_DIR/request.json:
  {"decode": {case: [array names]}, "decode_unchunked": [array names], "encode": {case: [array names]},
   "full_size_config": {...official config.json dict...}}
WORK_DIR/inputs.npz: the named arrays (codes [T, 16] int64, waveforms [n] float32).
Writes WORK_DIR/outputs.npz ("decode/<case>/<i>", "unchunked/<name>", "encode/<case>/<i>") and
WORK_DIR/report.json (loading report, attention classes, tensor shapes).
"""

import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModel
from transformers.utils import logging as hf_logging

from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model
from qwen_tts.inference.qwen3_tts_tokenizer import Qwen3TTSTokenizer


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(folder):
    """The public API, with every transformers warning recorded, plus transformers' own loading report."""
    hf_logging.set_verbosity_warning()
    handler = Collect()
    hf_logging.get_logger().addHandler(handler)  # the "transformers" root logger
    tok = Qwen3TTSTokenizer.from_pretrained(str(folder))
    hf_logging.get_logger().removeHandler(handler)
    _, info = AutoModel.from_pretrained(str(folder), output_loading_info=True)
    info = {k: sorted(map(str, v)) for k, v in info.items()}
    return tok, {"warnings": handler.messages, "loading_info": info}


def loaded_equals_file(model, folder):
    """Names of the file's tensors whose value in the loaded official model differs from the file."""
    state = model.state_dict()
    bad = []
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name not in state or not torch.equal(state[name].float(), f.get_tensor(name).float()):
                bad.append(name)
    return bad


def full_size_shapes(config_dict):
    config = Qwen3TTSTokenizerV2Config(**config_dict)
    with torch.device("meta"):
        model = Qwen3TTSTokenizerV2Model(config)
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def main():
    # Tiny model: small ops, where a second thread costs more than it gains (and much more on a busy machine).
    torch.set_num_threads(1)
    folder, work = Path(sys.argv[1]), Path(sys.argv[2])
    request = json.loads((work / "request.json").read_text())
    arrays = dict(np.load(work / "inputs.npz"))
    tok, report = load(folder)
    model = tok.model.eval()
    report["attention"] = {
        "encoder": type(model.encoder.encoder_transformer.layers[0].self_attn).__name__,
        "decoder": model.decoder.config._attn_implementation,
        "encoder_impl": model.encoder.config._attn_implementation,
    }
    report["state_dict_shapes"] = {k: list(v.shape) for k, v in model.state_dict().items()}
    report["differs_from_file"] = loaded_equals_file(model, folder)
    if request.get("full_size_config"):
        report["full_size_shapes"] = full_size_shapes(request["full_size_config"])

    out = {}
    for case, names in request.get("decode", {}).items():
        wavs, sr = tok.decode({"audio_codes": [torch.from_numpy(arrays[n]) for n in names]})
        assert sr == 24000
        for i, w in enumerate(wavs):
            out[f"decode/{case}/{i}"] = w
    with torch.inference_mode():
        for name in request.get("decode_unchunked", []):
            codes = torch.from_numpy(arrays[name]).T[None]  # [1, 16, T]
            out[f"unchunked/{name}"] = model.decoder(codes)[0, 0].numpy()
    for case, names in request.get("encode", {}).items():
        wavs = [arrays[n] for n in names]
        enc = tok.encode(wavs if len(wavs) > 1 else wavs[0], sr=24000)
        for i, c in enumerate(enc.audio_codes):
            out[f"encode/{case}/{i}"] = c.numpy()
    np.savez(work / "outputs.npz", **out)
    (work / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()

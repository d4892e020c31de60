"""Runs the official qwen-tts API on checkpoints and records what q3tts must reproduce.

usage: python generate.py CHECKPOINT CALLS.json OUT.pt [LORA]
       python generate.py MANIFEST.json      (a list of [CHECKPOINT, CALLS.json, OUT.pt]: one process for all,
                                              which saves the ~13 s of imports and start-up per checkpoint)

CALLS.json: a list of {"method": "generate_custom_voice" | ..., "kwargs": {...}}. Reference audio
is given as {"wav": path} (passed as the path) or {"array": path} (passed as an (array, sr) tuple). For each call OUT.pt
holds: the returned wavs, the generated codes, the raw talker logits (codec_head output of each forward, last
position), the raw code-predictor logits (lm_head[g] outputs, last position), the prefill inputs the talker
received, the prompt token ids, and for voice clone the prompt items (speaker embedding, reference codes).
"""

import json
import sys

import torch
from calls import audio_arg  # this script's folder is on sys.path
from qwen_tts import Qwen3TTSModel


def main(ckpt, calls_path, out_path, lora=None):
    torch.manual_seed(0)
    tts = Qwen3TTSModel.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa")
    if lora is not None:  # a PEFT LoRA adapter, applied by peft (unmerged: its own forward)
        from peft import PeftModel

        tts.model = PeftModel.from_pretrained(tts.model, lora).base_model.model
    model, talker = tts.model, tts.model.talker
    rec = {}

    def on_codec_head(_m, _inp, out):
        rec["talker_logits"].append(out[:, -1].detach().float().clone())

    def make_cp_hook(g):
        def hook(_m, _inp, out):
            rec["cp_logits"].append((g, out[:, -1].detach().float().clone()))
        return hook

    def on_talker_call(_m, args, kwargs):
        if kwargs.get("inputs_embeds") is not None and kwargs["inputs_embeds"].shape[1] > 1:
            rec["prefill"] = {k: kwargs[k].detach().clone() for k in
                              ("inputs_embeds", "attention_mask", "trailing_text_hidden", "tts_pad_embed")}

    talker.codec_head.register_forward_hook(on_codec_head)
    for g, head in enumerate(talker.code_predictor.lm_head):
        head.register_forward_hook(make_cp_hook(g))
    talker.register_forward_pre_hook(on_talker_call, with_kwargs=True)

    original_generate = model.generate

    def recording_generate(*args, **kwargs):
        rec["input_ids"] = [t.clone() for t in kwargs["input_ids"]]
        rec["instruct_ids"] = kwargs.get("instruct_ids")
        rec["ref_ids"] = kwargs.get("ref_ids")
        codes, hiddens = original_generate(*args, **kwargs)
        rec["codes"] = [c.clone() for c in codes]
        return codes, hiddens

    model.generate = recording_generate

    results = []
    with open(calls_path) as f:
        calls = json.load(f)
    for call in calls:
        rec.clear()
        rec.update(talker_logits=[], cp_logits=[])
        kwargs = {k: audio_arg(v) for k, v in call["kwargs"].items()}
        if call["method"] == "create_voice_clone_prompt":
            items = tts.create_voice_clone_prompt(**kwargs)
            results.append({"items": [{"ref_code": it.ref_code, "spk": it.ref_spk_embedding} for it in items]})
            continue
        if call["method"] == "generate_voice_clone" and "ref_audio" in kwargs:
            items = tts.create_voice_clone_prompt(ref_audio=kwargs["ref_audio"], ref_text=kwargs.get("ref_text"),
                                                  x_vector_only_mode=kwargs.get("x_vector_only_mode", False))
            rec["items"] = [{"ref_code": it.ref_code, "spk": it.ref_spk_embedding} for it in items]
        wavs, sr = getattr(tts, call["method"])(**kwargs)
        rec["wavs"] = [torch.from_numpy(w.copy()) for w in wavs]
        rec["sr"] = sr
        rec["threads"] = torch.get_num_threads()  # (float32 sums depend on it: the audio is bit-identical at equal counts)
        results.append(dict(rec))
    torch.save(results, out_path)
    print("ok", len(results))


if __name__ == "__main__":
    if len(sys.argv) == 2:
        with open(sys.argv[1]) as f:
            for ckpt, calls_path, out_path in json.load(f):
                main(ckpt, calls_path, out_path)
    else:
        main(*sys.argv[1:5])

"""A full-size random checkpoint (default: 1.7B CustomVoice) in the official on-disk layout, EOS disabled.

Speed does not depend on weight values, so tts-bench runs on random weights at the real config
(`q3tts/configs/`, the released `config.json` values): model.safetensors (bf16, every tensor of the official
file), speech_tokenizer/ (fp32, encoder and decoder, the vocoder rescaled as the tiny one is so that its
output stays inside [-1, 1] and reads as audible), and a text tokenizer. Both q3tts and nari-qwen3-tts load the
folder as they load the released one.

* EOS: the codec head's EOS row (2150) is zeroed, so EOS has logit 0 and never enters the top 50 of 2,048
  random logits: every request runs to `max_new_tokens` (q3tts, like the official code: max_new_tokens - 1
  frames).
* Text tokenizer: no Qwen vocabulary is available offline. A byte-level BPE in the Qwen2 layout is trained on
  the benchmark's prompts (so English words are single tokens, about as Qwen's real vocabulary splits them),
  its vocab.json padded with unreachable entries to 151,643 rows, so the special tokens sit at their official
  ids (<|im_start|> 151644, <tts_pad> 151671 ...) and "assistant" at 77091, the config's assistant_token_id.

    python bench/tts_bench/build_ckpt.py --out /tmp/ckpt/1.7B-CustomVoice [--device cuda]
    # nari-qwen3-tts finds it offline as the default model in a hub cache laid out with --hub-cache DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from q3tts.config import ModelConfig, SpeechTokenizerConfig
from q3tts.models.qwen3_tts import Qwen3TTSModel
from q3tts.models.speech_tokenizer import SpeechTokenizer
from q3tts.request.text_tokenizer import PRETOKENIZE_REGEX
from q3tts.tiny.random_init import random_state_dict
from q3tts.tiny.speech_tokenizer import CONFIGURATION, PREPROCESSOR_CONFIG, condition_vocoder
from q3tts.tiny.text_tokenizer import SPECIAL_TOKENS

CONFIGS = Path(__file__).resolve().parents[2] / "q3tts" / "configs"
PROMPTS = Path(__file__).with_name("prompts-en.jsonl")
N_BASE_VOCAB = 151_643  # Qwen2's byte-level BPE rows; the special tokens follow
ASSISTANT_ID = 77_091
# The revision nari-qwen3-tts pins for its default model (nari_qwen3_tts.config.DEFAULT_MODEL_REVISION).
NARI_MODEL_ID, NARI_REVISION = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "0c0e3051f131929182e2c023b9537f8b1c68adfe"


def write_text_tokenizer(folder: Path, corpus: list[str], bpe_size: int = 6000) -> int:
    """vocab.json (151,643 rows, the tail unreachable), merges.txt and tokenizer_config.json; returns the BPE's
    own row count."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*corpus, "assistant", "user", "system"] * 3, trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(state["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    base = len(vocab)
    for i in range(N_BASE_VOCAB - base):  # no merge produces these: never emitted
        vocab[f"<|q3tts_unused_{i}|>"] = base + i
    swap = next(k for k, v in vocab.items() if v == ASSISTANT_ID)
    vocab[swap], vocab["assistant"] = vocab["assistant"], ASSISTANT_ID
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(N_BASE_VOCAB + i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                     "single_word": False, "special": special}
             for i, (text, special) in enumerate(SPECIAL_TOKENS)}
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
              "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
              "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
              "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    _write_json(folder / "tokenizer_config.json", config)
    return base


def check_special_ids(config: dict) -> None:
    """The config's token ids must be where the tokenizer puts them."""
    ids = {text: N_BASE_VOCAB + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    want = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "tts_pad_token_id": "<tts_pad>",
            "tts_bos_token_id": "<tts_text_bos>", "tts_eos_token_id": "<tts_text_eod>"}
    for key, text in want.items():
        if config[key] != ids[text]:
            raise SystemExit(f"{key} is {config[key]} in the config, {ids[text]} in the tokenizer")
    if config["assistant_token_id"] != ASSISTANT_ID:
        raise SystemExit(f"assistant_token_id is {config['assistant_token_id']}, not {ASSISTANT_ID}")


def write_model(folder: Path, name: str, device: str, seed: int) -> int:
    raw = json.loads((CONFIGS / f"{name}.json").read_text())
    check_special_ids(raw)
    _write_json(folder / "config.json", raw)
    _write_json(folder / "generation_config.json", json.loads((CONFIGS / "generation_config.json").read_text()))
    _write_json(folder / "preprocessor_config.json", {"processor_class": "Qwen3TTSProcessor"})
    config = ModelConfig.from_file(folder / "config.json")
    tensors = random_state_dict(Qwen3TTSModel.checkpoint_shapes(config), seed, device=device, dtype=torch.bfloat16)
    tensors["talker.codec_head.weight"][config.talker_config.codec_eos_token_id] = 0
    save_file({k: v.cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in tensors.values())


def write_speech_tokenizer(folder: Path, device: str, seed: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CONFIGS / "speech_tokenizer.json", folder / "config.json")
    config = SpeechTokenizerConfig.from_file(folder / "config.json")
    tensors = random_state_dict(SpeechTokenizer.checkpoint_shapes(config), seed, device=device)
    condition_vocoder(tensors, config, seed)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    _write_json(folder / "configuration.json", CONFIGURATION)
    return sum(t.numel() for t in tensors.values())


def link_hub_cache(folder: Path, cache: Path) -> Path:
    """A hub cache entry for nari-qwen3-tts's default model at its pinned revision, pointing at `folder`, so
    that `--model-cache-dir CACHE --local-files-only` loads it with no network and the served model id stays
    the official one (the id tts-bench sends)."""
    repo = cache / ("models--" + NARI_MODEL_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(NARI_REVISION)
    link = repo / "snapshots" / NARI_REVISION
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)
    for path in sorted(folder.rglob("*")):  # a real folder of links to the files, as the hub lays it out:
        target = link / path.relative_to(folder)  # nari reads the revision from the resolved folder's path
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path.resolve())
    return link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default="1.7B-CustomVoice", help="a name from q3tts/configs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hub-cache", type=Path, help="also lay out a hub cache entry for nari-qwen3-tts here")
    args = parser.parse_args()
    t0 = time.time()
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    corpus = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    bpe_rows = write_text_tokenizer(args.out, corpus)
    main_params = write_model(args.out, args.config, args.device, args.seed)
    codec_params = write_speech_tokenizer(args.out / "speech_tokenizer", args.device, args.seed)
    link = link_hub_cache(args.out, args.hub_cache) if args.hub_cache else None
    sizes = {str(p.relative_to(args.out)): p.stat().st_size for p in sorted(args.out.rglob("*")) if p.is_file()}
    print(json.dumps({"built": str(args.out), "config": args.config, "seconds": round(time.time() - t0, 1),
                      "main_params": main_params, "speech_tokenizer_params": codec_params, "bpe_rows": bpe_rows,
                      "hub_snapshot": str(link) if link else None, "files": sizes}))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

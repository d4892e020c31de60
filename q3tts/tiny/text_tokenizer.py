"""A small byte-level BPE in the Qwen2 layout (vocab.json, merges.txt, tokenizer_config.json).

No Qwen vocabulary is available offline, so tiny checkpoints carry their own: trained here on a fixed corpus,
with the Qwen special tokens appended in their official order right after the BPE vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ..request.text_tokenizer import PRETOKENIZE_REGEX

# The official order of Qwen's added tokens (ids 151643...); Qwen3-TTS uses <tts_pad>, <tts_text_bos>,
# <tts_text_eod> at offsets 28, 29, 30.
SPECIAL_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True),
]

_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars shine above quiet hills and rivers "
    "hello world this is a test of speech synthesis please speak clearly slowly warmly with a calm voice "
    "assistant user system good morning evening thank you very much it's don't I'm we're they've you'll "
    "numbers one two three four five six seven eight nine ten hundred thousand 2026 3.14 42 "
    "happy sad angry excited whisper loudly young old man woman child narrator story news weather "
    "你好 世界 今天 天气 很好 我们 一起 说话 谢谢 再见 こんにちは 안녕하세요 Bonjour Hallo Hola Ciao Привет "
)


def _corpus() -> list[str]:
    words = _WORDS.split()
    lines = []
    for i in range(len(words)):
        chunk = words[i:i + 9]
        lines.append(" ".join(chunk) + ".")
        lines.append("<|im_start|>assistant\n" + " ".join(chunk) + "<|im_end|>\n")
        lines.append("<|im_start|>user\n" + " ".join(reversed(chunk)) + "!<|im_end|>\n")
    return lines * 3


def write_tiny_text_tokenizer(folder: Path, vocab_size: int = 700) -> dict[str, int]:
    """Trains and writes the tokenizer files; returns the ids of the special tokens the model config needs."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Special-token markup is split off before training so that it never becomes part of the BPE vocabulary.
    corpus = [part for line in _corpus() for part in line.replace("<|im_start|>", "\x00").replace(
        "<|im_end|>", "\x00").split("\x00") if part]
    tok.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    base = len(vocab)

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {str(base + i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special}
             for i, (text, special) in enumerate(SPECIAL_TOKENS)}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
        "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    ids = {text: base + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    return {
        "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"],
        "tts_eos_token_id": ids["<tts_text_eod>"], "assistant_token_id": vocab.get("assistant", 0),
        "text_vocab_size": base + len(SPECIAL_TOKENS) + 1,
    }

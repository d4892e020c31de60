"""The Qwen2 byte-level BPE text tokenizer, built with `tokenizers` from the checkpoint's vocab.json/merges.txt.

It reproduces what the official pipeline gets from `AutoProcessor.from_pretrained(path, fix_mistral_regex=True)`
under its pinned transformers 4.57.3: for a local Qwen3-TTS folder that call REPLACES the Qwen2 pre-tokenizer
regex by the "fixed Mistral" one (no contraction splitting, CamelCase split, `/` kept after punctuation).
The equivalence tests compare token ids with the official processor.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ..config import read_json

# transformers 4.57.3 tokenization_utils_base._patch_mistral_regex, applied by the official loader.
PRETOKENIZE_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ROLE_PREFIX = "<|im_start|>assistant\n"  # 3 tokens
ROLE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # 5 tokens


def assistant_text(text: str) -> str:
    return f"{ROLE_PREFIX}{text}{ROLE_SUFFIX}"


def ref_text(text: str) -> str:
    return f"{ROLE_PREFIX}{text}<|im_end|>\n"


def instruct_text(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n"


class TextTokenizer:
    """Encodes prompt strings to token ids exactly as the official processor does."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        prefix, suffix = self.encode(ROLE_PREFIX), self.encode(ROLE_SUFFIX)
        # The official model code slices prompts positionally and relies on these counts.
        if len(prefix) != 3 or len(suffix) != 5:
            raise ValueError(f"tokenizer splits {ROLE_PREFIX!r} into {len(prefix)} tokens (expected 3) or "
                             f"{ROLE_SUFFIX!r} into {len(suffix)} (expected 5)")

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer:
        vocab, merges = folder / "vocab.json", folder / "merges.txt"
        for path in (vocab, merges):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: text tokenizer file not found")
        tok = Tokenizer(BPE.from_file(str(vocab), str(merges), unk_token=None, continuing_subword_prefix="",
                                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        _add_tokens(tok, folder / "tokenizer_config.json")
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, text: str) -> tuple[list[int], list[int]]:
        """`encode(text)` and, for each id, where in `text` its piece starts (the pre-token it was cut from: an added
        token, or a split of the pre-tokenizer; characters, for text that is NFC already)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        starts, word, start = [], None, 0
        for w, (a, _) in zip(encoding.word_ids, encoding.offsets):
            if w != word:  # (a new piece; ids without one, if any, are taken as one piece: no cut among them)
                word, start = w, a
            starts.append(start)
        return encoding.ids, starts

    def added_contents(self) -> list[str]:
        """The added tokens' strings (split out of any text before the pre-tokenizer)."""
        return [token.content for token in self._tok.get_added_tokens_decoder().values()]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def _add_tokens(tok: Tokenizer, config_path: Path) -> None:
    """Adds the checkpoint's added tokens (`added_tokens_decoder`) at their declared ids."""
    entries = read_json(config_path).get("added_tokens_decoder", {})
    for token_id, entry in sorted(entries.items(), key=lambda kv: int(kv[0])):
        token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                           lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                           normalized=entry.get("normalized", False), special=entry.get("special", False))
        if entry.get("special", False):
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        if tok.token_to_id(entry["content"]) != int(token_id):
            raise ValueError(f"{config_path}: added token {entry['content']!r} landed at id "
                             f"{tok.token_to_id(entry['content'])}, the file says {token_id}")

"""`language` as clients send it: the model's own names ("English", "auto"), ISO 639-1 / 639-2 codes ("en", "eng")
and BCP-47 tags or locales ("en-US", "zh-Hans-CN", "pt_BR"), case-insensitively, as the model's name; Kokoro-FastAPI's
one-letter `lang_code` too. The model speaks languages, not regions or scripts: a tag's subtags after the first
say nothing the model can use, and are dropped (a checkpoint's dialects are reached through its speakers).
"""

from __future__ import annotations

import re

from ..errors import quote
from . import errors

# ISO 639-1 and 639-2 (bibliographic and terminological) codes of the Qwen3-TTS languages
CODES = {"zh": "chinese", "zho": "chinese", "chi": "chinese", "cmn": "chinese",
         "en": "english", "eng": "english",
         "de": "german", "deu": "german", "ger": "german",
         "it": "italian", "ita": "italian",
         "pt": "portuguese", "por": "portuguese",
         "es": "spanish", "spa": "spanish",
         "ja": "japanese", "jpn": "japanese",
         "ko": "korean", "kor": "korean",
         "fr": "french", "fra": "french", "fre": "french",
         "ru": "russian", "rus": "russian"}
# Kokoro-FastAPI's lang_code (misaki's pipelines): a/b American and British English, e Spanish, f French, h Hindi,
# i Italian, j Japanese, p Brazilian Portuguese, z Mandarin Chinese
KOKORO_CODES = {"a": "english", "b": "english", "e": "spanish", "f": "french", "h": "hindi", "i": "italian",
                "j": "japanese", "p": "portuguese", "z": "chinese"}
_TAG = re.compile(r"([a-z]{2,3})([-_][a-z0-9]{1,8})*")


def model_language(value: str, supported: list[str], param: str = "language") -> str:
    """The model's name for `value`, one of `supported` (lower-case, with "auto"); a 400 listing them if none."""
    text = value.strip().lower()
    if text in supported:
        return text
    tag = _TAG.fullmatch(text)
    name = CODES.get(tag.group(1)) if tag else None
    if name in supported:
        return name
    raise errors.bad_request(f"unsupported {param} {quote(value)}; supported: {', '.join(_listed(supported))} "
                             "(a name, an ISO 639-1 code or a BCP-47 tag such as en-US, any case)", param=param)


def kokoro_language(code: str, supported: list[str]) -> str:
    """Kokoro-FastAPI's one-letter `lang_code` as the model's language."""
    name = KOKORO_CODES.get(code.strip().lower())
    if name not in supported:
        known = ", ".join(f"{k} ({v})" for k, v in KOKORO_CODES.items() if v in supported)
        raise errors.bad_request(f"unsupported lang_code {quote(code)}; this model takes {known}", param="lang_code")
    return name


def _listed(supported: list[str]) -> list[str]:
    """Each language with its ISO 639-1 code: "english (en)"."""
    short = {name: code for code, name in CODES.items() if len(code) == 2}
    return [f"{name} ({short[name]})" if name in short else name for name in supported]

"""Voice blends: a new x-vector voice as the weighted mean of other voices' speaker embeddings.

The mix is sum(w_i * e_i) / sum(w_i), computed in float64 and stored as float32: the weights are normalised to sum
to 1 (so "a(2)+b(1)" is "a(4)+b(2)"), and nothing else is renormalised (the mean of two embeddings is shorter than
either; the model takes it as it is, as Kokoro-FastAPI takes its mixed style vectors). Only x-vector voices mix:
an in-context voice is one recording's codes and transcript, which have no mean. `parse_mix` reads Kokoro's
syntax for a mix, `"a(2)+b(1)"` (a bare name weighs 1).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..errors import RequestError, quote

_TERM = re.compile(r"\s*(?P<name>[^()+]+?)\s*(?:\(\s*(?P<weight>[^()]*?)\s*\))?\s*")


def is_mix(text: str) -> bool:
    """Whether a `voice` names a mix ("a+b", "a(2)"), not one voice (names of voices hold none of "+()")."""
    return any(c in text for c in "+()")


def parse_mix(text: str, param: str = "voice") -> list[tuple[str, float]]:
    """Kokoro's `"a(2)+b(1)"` as [(name, weight)]; RequestError naming `param` if it is not one."""
    terms = []
    for part in text.split("+"):
        match = _TERM.fullmatch(part)
        if match is None or not match["name"].strip():
            raise RequestError(f"{param} {quote(text)}: a mix is names with optional weights, e.g. "
                               "\"voice_a(2)+voice_b(1)\"", param)
        weight = match["weight"]
        try:
            value = 1.0 if weight is None else float(weight)
        except ValueError:
            raise RequestError(f"{param} {quote(text)}: the weight {quote(weight)} of {quote(match['name'])} is not a "
                               "number", param) from None
        terms.append((match["name"], value))
    return terms


def mixed_embedding(named: list[tuple[str, Any, float]], param: str) -> tuple[torch.Tensor, str | None]:
    """The mix of (name, Voice, weight) items and their model size ("0b6" / "1b7" / None). RequestError naming
    `param` (and the voice by `name`): no voices, a weight that is not a finite number > 0, an in-context voice,
    voices of different sizes."""
    if not named:
        raise RequestError(f"{param}: a blend needs at least one voice", param)
    for name, voice, weight in named:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise RequestError(f"{param}: the weight of {name} must be a finite number > 0, got {quote(weight)}",
                               param)
        if voice.icl_mode:
            raise RequestError(f"{param}: {name} is an in-context voice: its reference recording's codes and "
                               "transcript cannot be mixed; blend x-vector voices (made with x_vector_only, or from "
                               "an embedding)", param)
    sizes = sorted({voice.ref_spk_embedding.numel() for _, voice, _ in named})
    model_sizes = {voice.model_size for _, voice, _ in named} - {None}
    if len(sizes) > 1 or len(model_sizes) > 1:
        raise RequestError(f"{param}: the voices are for different model sizes (embedding sizes {sizes}): blend "
                           "voices made with one model", param)
    weights = [float(w) for _, _, w in named]
    try:
        total = math.fsum(weights)
    except OverflowError:  # (each finite, their sum past the largest float: the same ratios, scaled down)
        weights = [w / max(weights) for w in weights]
        total = math.fsum(weights)
    mixed = sum(v.ref_spk_embedding.reshape(-1).to("cpu", torch.float64) * (w / total)
                for (_, v, _), w in zip(named, weights))
    return mixed.float().contiguous(), next(iter(model_sizes), None)

"""PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) of the talker and the code predictor,
merged into the checkpoint's weights as they load: W + (B @ A) * scaling, in float32, as peft's `merge_and_unload`
computes it, so that the engine runs plain weights (no peft at run time, no extra kernels, graphs unchanged).

Adapters name modules as peft saved them: `base_model.model.<module>.lora_A.weight` ([r, in]) and `lora_B.weight`
([out, r]), `<module>` a path of the official model (`talker.model.layers.0.self_attn.q_proj`, or relative to the
talker when peft wrapped the talker alone). scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora;
`rank_pattern` and `alpha_pattern` override them per module, as peft matches them). What changes the model in
other ways (DoRA, biases, modules_to_save, embedding or convolution adapters) is refused, as is anything that does
not fit: a module this model does not have, a rank or shape that disagrees, an adapter for another model size.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import CheckpointError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<part>A|B)(?:\.[\w-]+)?\.weight")  # (".default": saved unfiltered)
UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)"}


@dataclass
class LoraConfig:
    """The parts of peft's `adapter_config.json` that a merge uses, checked."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    def scaling(self, module: str) -> tuple[int, float]:
        """(rank, scaling) of `module`, with peft's per-module patterns."""
        rank = self.rank_pattern.get(_pattern_key(self.rank_pattern, module), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return rank, alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def targets(self, module: str) -> bool:
        """Whether `target_modules` names `module` (a regex over the whole name, or names of its last parts)."""
        if self.target_modules is None:
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def read_adapter(folder: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """An adapter folder's config and weights; CheckpointError naming the file and what is wrong."""
    from safetensors.torch import load_file

    path = folder / CONFIG
    if not path.is_file() or not (folder / WEIGHTS).is_file():
        raise CheckpointError(f"{folder}: not a LoRA adapter folder (it needs {CONFIG} and {WEIGHTS}, as peft's "
                              "save_pretrained writes them)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: a {raw.get('peft_type')} adapter; q3tts merges LoRA adapters only")
    for key, what in UNSUPPORTED.items():
        if raw.get(key):
            raise CheckpointError(f"{path}: {key} is set: {what} cannot be merged as plain LoRA")
    if raw.get("bias", "none") != "none" or raw.get("modules_to_save"):
        raise CheckpointError(f"{path}: the adapter trains biases or whole modules (bias {raw.get('bias')!r}, "
                              f"modules_to_save {raw.get('modules_to_save')!r}); q3tts merges LoRA weights only")
    if not isinstance(raw.get("r"), int) or raw["r"] < 1 or not isinstance(raw.get("lora_alpha"), (int, float)):
        raise CheckpointError(f"{path}: r must be an integer >= 1 and lora_alpha a number")
    config = LoraConfig(**{k: raw[k] for k in LoraConfig.__dataclass_fields__ if raw.get(k) is not None})
    return config, load_file(str(folder / WEIGHTS))


def merge_lora(tensors: dict[str, torch.Tensor], folder: Path) -> list[str]:
    """Adds the adapter in `folder` to `tensors` (the checkpoint's, by name) in place; returns the merged names."""
    config, weights = read_adapter(folder)
    pairs = _pairs(weights, folder)
    named = {_module_weight(tensors, module, folder, config): ab for module, ab in pairs.items()}
    for name, (a, b) in named.items():
        _check_shapes(tensors[name], name, a, b, config, folder)
    _check_targets(config, tensors, folder)
    for name, (a, b) in named.items():
        w = tensors[name]
        delta = (b.float() @ a.float()) * config.scaling(name.removesuffix(".weight"))[1]
        tensors[name] = (w.float() + delta).to(w.dtype)
    return sorted(named)


def _pairs(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.fullmatch(key.removeprefix(PREFIX))
        if match is None:
            raise CheckpointError(f"{folder / WEIGHTS}: tensor {key} {list(tensor.shape)} is not a LoRA A or B "
                                  "matrix of a linear layer (embedding and convolution adapters are not supported)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{folder / WEIGHTS}: module {module} has lora_{next(iter(ab))} but no "
                                  f"lora_{'B' if 'A' in ab else 'A'}")
    if not parts:
        raise CheckpointError(f"{folder / WEIGHTS}: holds no LoRA weights")
    return {module: (ab["A"], ab["B"]) for module, ab in parts.items()}


def _module_weight(tensors: dict[str, torch.Tensor], module: str, folder: Path, config: LoraConfig) -> str:
    """The checkpoint tensor a module's adapter changes: its path as the full model or the talker names it."""
    for name in (f"{module}.weight", f"talker.{module}.weight"):
        if name in tensors and tensors[name].dim() == 2 and "embedding" not in name:
            return name
    example = next(n for n in tensors if n.endswith("q_proj.weight")).removesuffix(".weight")
    hint = f" (base model: {config.base_model_name_or_path})" if config.base_model_name_or_path else ""
    raise CheckpointError(f"{folder / WEIGHTS}: an adapter of module {module}, which this model does not have as a "
                          f"linear layer{hint}; its linear layers are named like {example}")


def _check_shapes(w: torch.Tensor, name: str, a: torch.Tensor, b: torch.Tensor, config: LoraConfig,
                  folder: Path) -> None:
    module = name.removesuffix(".weight")
    rank = config.scaling(module)[0]
    out, inp = w.shape
    shapes = f"lora_A {list(a.shape)}, lora_B {list(b.shape)}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != rank:
        raise CheckpointError(f"{folder}: module {module}: rank mismatch: {shapes}, the config's rank {rank}")
    if a.shape[1] != inp or b.shape[0] != out:
        raise CheckpointError(f"{folder}: module {module} is [{out}, {inp}] in this model, the adapter's {shapes}: "
                              "an adapter for another model size?")


def _check_targets(config: LoraConfig, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """A target module name that matches none of this model's linear layers is an adapter for another model."""
    if not isinstance(config.target_modules, list):
        return
    linear = [n.removesuffix(".weight") for n, t in tensors.items() if t.dim() == 2 and n.endswith(".weight")]
    missing = [t for t in config.target_modules if not any(m == t or m.endswith("." + t) for m in linear)]
    if missing:
        raise CheckpointError(f"{folder / CONFIG}: target_modules {missing} name no linear layer of this model")


def _pattern_key(patterns: dict, module: str) -> str | None:
    """peft's match of a rank_pattern / alpha_pattern key: the pattern ending the module's name."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), None)

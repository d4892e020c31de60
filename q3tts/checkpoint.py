"""Finding a checkpoint (local folder or hub id) and loading its safetensors with every tensor accounted for."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

TINY_HINT = ("pass a local folder that holds a downloaded checkpoint (config.json, model.safetensors, "
             "speech_tokenizer/), or check the pipeline without weights with a built-in random model: `tiny` "
             "(CustomVoice), `tiny-base` (voice cloning) or `tiny-voice-design`, noise only and never ending on its "
             "own, so limit max_new_tokens (e.g. `q3tts say Hi --model tiny --max-new-tokens 50`)")


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or does not match the model it should hold."""


def resolve_model_dir(name_or_path: str | os.PathLike, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                      token: str | bool | None = None) -> Path:
    """A local checkpoint folder, or a hub id (`Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice`) fetched into the
    huggingface_hub cache. `HF_HUB_OFFLINE=1` or `local_files_only` consult only the cache; `token` is
    huggingface_hub's."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"{text}: no such checkpoint folder; {TINY_HINT}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(text, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                                      token=token))
    except LocalEntryNotFoundError as e:
        where = "with local_files_only=True" if local_files_only else "and the hub cannot be reached"
        raise CheckpointError(f"{text}: not in the local hub cache {where} ({e}); {TINY_HINT}") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{text}: could not fetch it from the hub ({e}); {TINY_HINT}") from e


def load_tensors(path: Path, expected: dict[str, tuple[int, ...]], ignored: Iterable[str] = (),
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Reads `path` and returns exactly the `expected` tensors, converted to `dtype` (floating ones only).

    `ignored` holds regular expressions for tensors the file carries that this implementation deliberately
    does not use; any other tensor in the file, and any missing or misshapen expected one, is an error that
    names the file, the tensor and the expected shape.
    """
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    ignore = [re.compile(p) for p in ignored]
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            missing = sorted(set(expected) - names)
            if missing:
                listing = ", ".join(f"{n} {list(expected[n])}" for n in missing[:8])
                more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
                raise CheckpointError(f"{path}: missing tensors: {listing}{more}")
            unknown = sorted(n for n in names - set(expected) if not any(p.fullmatch(n) for p in ignore))
            if unknown:
                raise CheckpointError(f"{path}: unexpected tensors (not part of this model): "
                                      f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}")
            for name, shape in expected.items():
                found = tuple(f.get_slice(name).get_shape())
                if found != tuple(shape):
                    raise CheckpointError(f"{path}: tensor {name} has shape {list(found)}, expected {list(shape)}")
                t = f.get_tensor(name)
                tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    return tensors


def module_shapes(module: torch.nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Names and shapes of a module's persistent parameters and buffers, as its checkpoint stores them."""
    return {prefix + k: tuple(v.shape) for k, v in module.state_dict().items()}


def instantiate(build, tensors: dict[str, torch.Tensor], device: torch.device | str) -> torch.nn.Module:
    """Builds a module without initialising it and adopts `tensors` as its parameters and persistent buffers,
    in their own dtype (every one must be there). Non-persistent buffers (RoPE frequencies, always fp32) are
    created by each module's `init_buffers()`."""
    with torch.device("meta"):
        module = build()
    module.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=True, assign=True)
    for m in module.modules():
        init = getattr(m, "init_buffers", None)
        if init is not None:
            init()
    missing = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if missing:
        raise RuntimeError(f"tensors left uninitialised after loading: {missing[:5]}")
    return module

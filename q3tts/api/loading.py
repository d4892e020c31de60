"""Finding and checking a checkpoint before loading it: a local folder, a hub id (fetched into the huggingface_hub
cache) or a built-in tiny model; the device and dtype arguments. Apart from `q3tts.checkpoint`, which only reads a
folder's safetensors (the models load through it and fetch nothing)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint import CheckpointError
from ..config import ModelConfig

TINY_HINT = ("pass a local folder that holds a downloaded checkpoint (config.json, model.safetensors, "
             "speech_tokenizer/), or check the pipeline without weights with a built-in random model: `tiny` "
             "(CustomVoice), `tiny-base` (voice cloning) or `tiny-voice-design`, noise only and never ending on its "
             "own, so limit max_new_tokens (e.g. `q3tts say Hi --model tiny --max-new-tokens 50`)")



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



def resolve_checkpoint(name_or_path: str | Path, revision: str | None = None, cache_dir: str | Path | None = None,
                       local_files_only: bool = False, token: str | bool | None = None) -> Path:
    """The folder of a checkpoint folder, hub id (fetched) or built-in tiny model name, without loading it."""
    from ..tiny import TINY_NAMES, tiny_checkpoint

    if str(name_or_path) in TINY_NAMES:
        return tiny_checkpoint(str(name_or_path))
    return resolve_model_dir(name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                             token=token)


def check_adapter(lora: str | os.PathLike) -> None:
    """A `lora` that names a local path must be an adapter folder (CheckpointError naming it; a hub id is checked
    once fetched): the checkpoint's message, about config.json and speech_tokenizer/, would mislead."""
    from ..models.lora import CONFIG, WEIGHTS

    path, text = Path(lora).expanduser(), str(lora)
    needs = f"a LoRA adapter is a folder or hub id with {CONFIG} and {WEIGHTS}, as peft's save_pretrained writes them"
    if path.is_dir():
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise CheckpointError(f"lora {text}: not a LoRA adapter folder; {needs}")
    elif path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"lora {text}: no such adapter folder; {needs}")


def check_checkpoint(name_or_path: str | Path) -> ModelConfig:
    """A checkpoint's config, checked without loading its weights (seconds sooner than `from_pretrained` fails):
    the folder is there (a hub id is fetched), its config.json reads, and its safetensors files are whole."""
    from safetensors import SafetensorError, safe_open

    folder = resolve_checkpoint(name_or_path)
    config = ModelConfig.from_file(folder / "config.json")
    for path in (folder / "model.safetensors", folder / "speech_tokenizer" / "model.safetensors"):
        if not path.is_file():
            raise CheckpointError(f"{path}: file not found")
        try:
            with safe_open(str(path), framework="pt"):  # (reads the header: a truncated file fails here)
                pass
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    return config


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A device argument (None / "auto": a GPU if there is one), refused with a clear error if unusable here."""
    if isinstance(device, dict):
        raise ValueError("device_map as a dict (model sharding) is not supported: pass one device, e.g. 'cuda:0'")
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but this machine has no usable CUDA GPU "
                         f"(torch {torch.__version__}); use device 'cpu'")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """A dtype argument (None / "auto": bfloat16 on a GPU, float32 on the CPU)."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
        dtype = value
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
    return dtype

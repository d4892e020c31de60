"""Loading a checkpoint folder's safetensors with every tensor accounted for (finding the folder, which may fetch
it from the hub, is `q3tts.api.loading`'s)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or does not match the model it should hold."""


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

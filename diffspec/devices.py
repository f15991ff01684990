"""Turn the ``device`` and ``dtype`` settings into torch objects."""

from __future__ import annotations

import torch

from diffspec.errors import InvalidRequest

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto = the first CUDA/ROCm GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as bad:
        raise InvalidRequest(f"unknown device {name!r}: {bad}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"device {name!r} asked for, but no GPU is visible")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = float32 on the CPU (exact tests), bfloat16 on a GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise InvalidRequest(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Read a checkpoint's tensors: single or sharded safetensors, or the ``pytorch_model.bin`` that
published EAGLE-3 heads ship. Errors name the file and the problem."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffspec.errors import CheckpointError

SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"


def _weight_map(model_dir: Path) -> dict[str, str] | None:
    """tensor name -> shard file name from the index, or None for an unsharded checkpoint."""
    index = model_dir / SAFETENSORS_INDEX
    if not index.exists():
        return None
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as bad:
        raise CheckpointError(f"{index} is malformed: {bad}") from None


def has_safetensors(model_dir: Path) -> bool:
    model_dir = Path(model_dir)
    return (model_dir / SAFETENSORS_INDEX).exists() or any(model_dir.glob("*.safetensors"))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, or the single file."""
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    if weight_map is not None:
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {model_dir}")
    missing = [f for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"weight shard(s) missing: {', '.join(str(m) for m in missing)}")
    return files


def load_state_dict(files: list[Path], device: torch.device, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """All tensors of the given safetensors files, cast to ``dtype`` when it is floating point."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensors[name] = _cast(handle.get_tensor(name), device, dtype)
        except (OSError, RuntimeError, SafetensorError) as bad:
            raise CheckpointError(f"cannot read {path}: {bad}") from None
    return tensors


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor on the CPU, as stored: safetensors when present (as transformers prefers), else
    ``pytorch_model.bin`` read with ``weights_only`` (no code runs from the pickle)."""
    model_dir = Path(model_dir)
    if has_safetensors(model_dir):
        return load_state_dict(safetensors_files(model_dir), torch.device("cpu"), None)
    path = model_dir / TORCH_WEIGHTS
    if not path.exists():
        raise CheckpointError(f"no weights in {model_dir}: expected {TORCH_WEIGHTS} or *.safetensors")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as bad:
        raise CheckpointError(f"cannot read {path}: {bad}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path} is not a flat state dict of tensors")
    return state


def load_tensor(model_dir: Path, name: str, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """One tensor, read from the shard that holds it (the others are never opened)."""
    model_dir = Path(model_dir)
    weight_map = _weight_map(model_dir)
    files = safetensors_files(model_dir)
    if weight_map is not None:
        files = [model_dir / weight_map[name]] if name in weight_map else []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                if name in handle.keys():
                    return _cast(handle.get_tensor(name), device, dtype)
        except (OSError, RuntimeError, SafetensorError) as bad:
            raise CheckpointError(f"cannot read {path}: {bad}") from None
    raise CheckpointError(f"{model_dir} holds no {name}")


def _cast(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.to(device)

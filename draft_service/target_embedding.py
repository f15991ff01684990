"""Read only the target's token embedding: a draft service on another host needs nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from diffspec.errors import CheckpointError
from target_service.checkpoint import safetensors_files

EMBEDDING_KEY = "model.embed_tokens.weight"


def load_target_embedding(model_dir: Path, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[vocab, hidden] embedding from the shard that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = safetensors_files(model_dir)
    if index.exists():
        files = [model_dir / json.loads(index.read_text())["weight_map"].get(EMBEDDING_KEY, files[0].name)]
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            if EMBEDDING_KEY in handle.keys():
                return handle.get_tensor(EMBEDDING_KEY).to(device=device, dtype=dtype)
    raise CheckpointError(f"{model_dir} holds no {EMBEDDING_KEY}")

"""Read only the target's token embedding: a draft service on another host needs nothing else."""

from __future__ import annotations

from pathlib import Path

import torch

from diffspec.checkpoint import load_tensor

EMBEDDING_KEY = "model.embed_tokens.weight"


def load_target_embedding(model_dir: Path, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[vocab, hidden] embedding from the shard that holds it."""
    return load_tensor(model_dir, EMBEDDING_KEY, device, dtype)

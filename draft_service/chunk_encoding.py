"""Salience encodings of the draft's context: per chunk and KV head, the min and max key.

The index grows with the draft KV: only chunks that became full since the last update are
encoded, so the cost per step is O(new tokens), and the encodings take 2/chunk_size of the
keys' memory.
"""

from __future__ import annotations

import torch

from diffspec_kernels.chunk_scoring_ref import chunk_scores_reference
from diffspec_kernels.dispatch import triton_kernels_on


def _scorer(device: torch.device):  # noqa: ANN202 - one of two functions of the same signature
    """The Triton scorer for a GPU's keys, else the PyTorch reference."""
    if not triton_kernels_on(device):
        return chunk_scores_reference
    from diffspec_kernels.chunk_scoring_triton import chunk_scores_triton

    return chunk_scores_triton


class ChunkIndex:
    def __init__(self, chunk_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.chunk_size = chunk_size
        self.key_min = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)  # [chunks, kv_heads, hd]
        self.key_max = torch.empty_like(self.key_min)
        self._score = _scorer(device)

    @property
    def num_chunks(self) -> int:
        return self.key_min.shape[0]

    def update(self, keys: torch.Tensor) -> None:
        """keys [length, kv_heads, hd]: every committed key so far; encodes the newly full chunks."""
        full = keys.shape[0] // self.chunk_size
        if full <= self.num_chunks:
            return
        fresh = keys[self.num_chunks * self.chunk_size : full * self.chunk_size]
        fresh = fresh.view(full - self.num_chunks, self.chunk_size, *keys.shape[1:])
        self.key_min = torch.cat([self.key_min, fresh.amin(1)])
        self.key_max = torch.cat([self.key_max, fresh.amax(1)])

    def scores(self, q: torch.Tensor) -> torch.Tensor:
        """[num_chunks] float32 upper bounds of q . k per chunk (q [heads, hd])."""
        return self._score(q, self.key_min, self.key_max)

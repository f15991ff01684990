"""What the draft attends to: every committed entry (EAGLE-3 baseline) or the salience working set.

The full draft KV is always kept (chunks may re-enter the working set later); with salience on,
attention reads only the chunk arena (sinks, recent chunks, best-scoring chunks) plus the
partial tail chunk, so a draft step costs O(budget) instead of O(context).
"""

from __future__ import annotations

import torch

from draft_service.chunk_arena import ChunkArena
from draft_service.chunk_encoding import ChunkIndex
from draft_service.draft_kv import DraftKV
from draft_service.working_set import WorkingSetConfig, WorkingSetSelector


class DraftContext:
    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        salience: WorkingSetConfig | None = None,
    ) -> None:
        self.kv = DraftKV(num_kv_heads, head_dim, dtype, device)
        self.salience = salience
        if salience is not None:
            self.index = ChunkIndex(salience.chunk_size, num_kv_heads, head_dim, dtype, device)
            self.selector = WorkingSetSelector(salience)
            self.arena = ChunkArena(salience.max_chunks, salience.chunk_size, num_kv_heads, head_dim, dtype, device)

    @property
    def length(self) -> int:
        return self.kv.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv.append(k, v)

    def refresh(self, q: torch.Tensor) -> None:
        """Re-score chunks against the latest query [heads, hd] and update the arena if needed."""
        if self.salience is None:
            return
        keys, values = self.kv.view()
        self.index.update(keys)
        selected = self.selector.select(self.index.scores(q))
        if set(selected) != self.arena.chunks():
            self.arena.update(selected, keys, values)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [tokens, kv_heads, hd] the draft attends to."""
        if self.salience is None:
            return self.kv.view()
        keys, values = self.kv.view()
        tail = self.index.num_chunks * self.salience.chunk_size
        arena_k, arena_v = self.arena.view()
        return torch.cat([arena_k, keys[tail:]]), torch.cat([arena_v, values[tail:]])

    @property
    def attended_tokens(self) -> int:
        if self.salience is None:
            return self.kv.length
        return len(self.arena.slot_chunk) * self.salience.chunk_size + self.kv.length % self.salience.chunk_size

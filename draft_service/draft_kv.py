"""The draft's own KV over committed positions, of one decoder layer, growing geometrically.

With salience off the draft attends to all of it (the EAGLE-3 baseline); with salience on
it attends to the working set staged in the chunk arena instead.
"""

from __future__ import annotations

import torch


class DraftKV:
    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 1024):
        self.keys = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)  # [capacity, kv_heads, hd]
        self.values = torch.empty_like(self.keys)
        self.length = 0  # committed positions held

    def claim(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``n`` positions, counted as committed: [n, kv_heads, hd] keys and values for the
        caller to fill (a batch of sessions fills all of theirs in one copy)."""
        needed = self.length + n
        if needed > self.keys.shape[0]:
            capacity = max(needed, 2 * self.keys.shape[0])
            self.keys = _grown(self.keys, capacity, self.length)
            self.values = _grown(self.values, capacity, self.length)
        start, self.length = self.length, needed
        return self.keys[start:needed], self.values[start:needed]

    def keep(self, length: int) -> None:
        """Count only the first ``length`` positions as committed (claimed ones past them are free again)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot keep {length} of {self.length} committed positions")
        self.length = length

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[length, kv_heads, hd] keys and values of every committed position."""
        return self.keys[: self.length], self.values[: self.length]


def _grown(buffer: torch.Tensor, capacity: int, used: int) -> torch.Tensor:
    grown = torch.empty(capacity, *buffer.shape[1:], dtype=buffer.dtype, device=buffer.device)
    grown[:used] = buffer[:used]
    return grown

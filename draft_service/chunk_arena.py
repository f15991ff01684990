"""The chunk arena: the working set's KV held contiguous in a preallocated buffer.

Slots [0, num_used) always hold the selected chunks, so attention reads one contiguous span.
An update copies only chunks that enter; a chunk that leaves frees its slot, and the chunk in
the last used slot moves into the hole (one chunk copy) to keep the span dense. Memory is
fixed at construction, whatever the context length.
"""

from __future__ import annotations

import torch


class ChunkArena:
    def __init__(
        self, num_slots: int, chunk_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_slots, chunk_size, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [slots, chunk, kv_heads, hd]
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.chunk_size = chunk_size
        self.slot_chunk: list[int] = []  # chunk id held by each used slot
        self.copies = 0  # chunks copied in so far (entering chunks and compaction moves)

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def chunks(self) -> set[int]:
        return set(self.slot_chunk)

    def update(self, selected: list[int], source_keys: torch.Tensor, source_values: torch.Tensor) -> None:
        """Make the arena hold exactly ``selected`` chunks; sources are [length, kv_heads, hd]."""
        if len(selected) > self.num_slots:
            raise ValueError(f"{len(selected)} chunks selected for an arena of {self.num_slots} slots")
        wanted = set(selected)
        slot = 0
        while slot < len(self.slot_chunk):  # evict leavers, filling each hole from the end
            if self.slot_chunk[slot] in wanted:
                slot += 1
                continue
            last = len(self.slot_chunk) - 1
            if slot != last:
                self.keys[slot] = self.keys[last]
                self.values[slot] = self.values[last]
                self.slot_chunk[slot] = self.slot_chunk[last]
                self.copies += 1
            self.slot_chunk.pop()
        entering = [c for c in selected if c not in set(self.slot_chunk)]
        for chunk in entering:
            span = slice(chunk * self.chunk_size, (chunk + 1) * self.chunk_size)
            slot = len(self.slot_chunk)
            self.keys[slot] = source_keys[span]
            self.values[slot] = source_values[span]
            self.slot_chunk.append(chunk)
            self.copies += 1

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_used * chunk, kv_heads, hd] keys and values of the working set's chunks."""
        used = len(self.slot_chunk)
        return self.keys[:used].flatten(0, 1), self.values[:used].flatten(0, 1)

"""The chunk arena: the working set's KV held contiguous in a preallocated buffer.

Slots [0, num_used) always hold the selected chunks, so attention reads one contiguous span.
Memory is fixed at construction, whatever the context length.

An update is planned on the host, then done in a constant number of launches whatever the number
of chunks moved: the working set changes every few draft steps, for up to ~30 chunks, per decoder
layer and per session, and a copy per chunk would be dozens of tiny launches on the host's critical
path. The plan: a chunk that stays keeps its slot unless that slot is past the new end (the set
shrank); the free slots below the new end (leavers' slots, or unused ones) take those stragglers
first, then the entering chunks in ``selected`` order. So only entering chunks and stragglers are
copied, as one indexed copy each (keys and values), from one host-to-device upload of the slot and
chunk ids. A session's arenas of every decoder layer take one plan, and a batch's sessions whose sets
changed share one upload (``plan``, then ``apply``: ``draft_context.reselect_all``).

Order. Slots are in no particular chunk order, and nothing needs one: the committed keys are roped
when they are written (``Eagle3Head.attention_inputs``), and the draft attends to every context key
below its length with no mask between them (``draft_attention``), so the order changes only the
float summation order. The plan is deterministic, so every decoder layer's arena, given the same
selections, holds its chunks in the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArenaPlan:
    """How an arena holding ``held`` comes to hold ``selected``; every list is host ints."""

    slot_chunk: list[int]  # [len(selected)] chunk id each used slot holds afterwards
    move_from: list[int]  # [stragglers] slots at or past the new end whose chunk stays
    move_to: list[int]  # [stragglers] the free slots below the new end they move to
    enter_slots: list[int]  # [entering] the free slots the entering chunks go to
    enter_chunks: list[int]  # [entering] chunk ids not held before, in ``selected`` order

    @staticmethod
    def of(held: list[int], selected: list[int]) -> ArenaPlan:
        wanted, before, used = set(selected), set(held), len(selected)
        free = [s for s in range(used) if s >= len(held) or held[s] not in wanted]  # ascending
        move_from = [s for s in range(used, len(held)) if held[s] in wanted]
        enter_chunks = [c for c in selected if c not in before]
        move_to, enter_slots = free[: len(move_from)], free[len(move_from) :]  # len(free) == both together
        slot_chunk = held[:used] + [-1] * (used - len(held))
        for slot, source in zip(move_to, move_from):
            slot_chunk[slot] = held[source]
        for slot, chunk in zip(enter_slots, enter_chunks):
            slot_chunk[slot] = chunk
        return ArenaPlan(slot_chunk, move_from, move_to, enter_slots, enter_chunks)

    @property
    def ids(self) -> list[int]:
        """What an update uploads: the slot and chunk ids of its copies, in field order."""
        return [*self.move_from, *self.move_to, *self.enter_slots, *self.enter_chunks]


class ChunkArena:
    def __init__(
        self,
        num_slots: int,
        chunk_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_slots, chunk_size, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [slots, chunk, kv_heads, hd]
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.chunk_size = chunk_size
        self.slot_chunk: list[int] = []  # [num_used] chunk id held by each used slot
        self.copies = 0  # chunks copied in so far (entering chunks and stragglers moved below the end)
        self.batched_copies = 0  # indexed copies issued so far, each of keys and values: at most 2 an update

    @property
    def num_slots(self) -> int:
        return self.keys.shape[0]

    @property
    def num_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def chunks(self) -> set[int]:
        return set(self.slot_chunk)

    def plan(self, selected: list[int], num_full: int) -> ArenaPlan:
        """How the arena comes to hold ``selected``, distinct chunks among the sources' ``num_full`` full ones."""
        if len(selected) > self.num_slots:
            raise ValueError(f"{len(selected)} chunks selected for an arena of {self.num_slots} slots")
        if len(set(selected)) != len(selected) or any(not 0 <= c < num_full for c in selected):
            raise ValueError(f"selected chunks {selected} are not distinct full chunks of {num_full}")
        return ArenaPlan.of(self.slot_chunk, selected)

    def apply(
        self, plan: ArenaPlan, ids: torch.Tensor | None, source_keys: torch.Tensor, source_values: torch.Tensor
    ) -> None:
        """Carry out ``plan``, made by this arena or another holding the same chunks (a session's arenas of the
        other decoder layers); ``ids`` [len(plan.ids)]: its ids on the device (None when it copies nothing),
        uploaded by the caller, so the arenas of a batch share one upload."""
        self.slot_chunk = plan.slot_chunk
        if ids is None or ids.numel() == 0:
            return
        move_from, move_to, enter_slots, enter_chunks = ids.split(
            [len(plan.move_from), len(plan.move_to), len(plan.enter_slots), len(plan.enter_chunks)]
        )
        if plan.move_from:  # sources at or past the new end, targets below it: they never overlap
            for arena in (self.keys, self.values):
                arena.index_copy_(0, move_to, arena.index_select(0, move_from))
            self.copies += len(plan.move_from)
            self.batched_copies += 1
        if plan.enter_chunks:
            num_full = source_keys.shape[0] // self.chunk_size
            for arena, source in ((self.keys, source_keys), (self.values, source_values)):
                chunked = source[: num_full * self.chunk_size].unflatten(0, (num_full, self.chunk_size))
                arena.index_copy_(0, enter_slots, chunked.index_select(0, enter_chunks))
            self.copies += len(plan.enter_chunks)
            self.batched_copies += 1

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_used * chunk, kv_heads, hd] keys and values of the working set's chunks, in slot order."""
        used = len(self.slot_chunk)
        return self.keys[:used].flatten(0, 1), self.values[:used].flatten(0, 1)

"""The chunk arena: the working set's KV held contiguous in a preallocated buffer.

Slots [0, num_used) always hold the selected chunks, so attention reads one contiguous span.
Memory is fixed at construction, whatever the context length.

An update is planned on the host, then copied with every other update of the batch in one multi-tensor
copy: the working set changes at most draft steps at long context, for up to ~30 chunks, per decoder
layer and per session, and a launch per chunk, or even per session and layer, would be dozens of tiny
launches on the host's critical path. The plan: a chunk that stays keeps its slot unless that slot is
past the new end (the set shrank); the free slots below the new end (leavers' slots, or unused ones)
take those stragglers first, then the entering chunks in ``selected`` order. So only entering chunks
and stragglers are copied. A session's arenas of every decoder layer take one plan, and the copies of a
batch's arenas whose sets changed go in one ``torch._foreach_copy_`` (``plan``, then ``copy_views``:
``draft_context.reselect_all``).

Order. Slots are in no particular chunk order, and nothing needs one: the committed keys are roped
when they are written (``Eagle3Head.attention_inputs``), and the draft attends to every context key
below its length with no mask between them (``draft_attention``), so the order changes only the
float summation order. The plan is deterministic, so every decoder layer's arena, given the same
selections, holds its chunks in the same slots.

Compacted positions (``WorkingSetConfig.compact_positions``). The committed keys are roped at their own
positions, so a working set at 64K spans distances a head trained on short windows never saw. ``restage``
instead fills the arena with the chosen chunks in position order, each chunk's keys rotated by how far it
moves: the newest chunk keeps its positions and the others follow one another up to it. A rotation composes
with the one applied when the key was written (rope(k, p) rotated by d is rope(k, p + d)), so no unroped
key is kept. The positions then depend on the whole set, so each change restages every chunk. The chunks are
still scored and chosen at their own positions (``draft_context``); only the attention sees them moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffspec_kernels.layer_ops import layer_ops_for


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
        self.rotate = layer_ops_for(device).apply_rotary  # one launch on a GPU, bit for bit the reference's
        self.slot_chunk: list[int] = []  # [num_used] chunk id held by each used slot
        self.copies = 0  # chunks copied in so far (entering chunks and stragglers moved below the end)

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
        self._check_selection(selected, num_full)
        return ArenaPlan.of(self.slot_chunk, selected)

    def _check_selection(self, selected: list[int], num_full: int) -> None:
        """``selected`` fits the arena and names distinct chunks among ``num_full`` full ones."""
        if len(selected) > self.num_slots:
            raise ValueError(f"{len(selected)} chunks selected for an arena of {self.num_slots} slots")
        if len(set(selected)) != len(selected) or any(not 0 <= c < num_full for c in selected):
            raise ValueError(f"selected chunks {selected} are not distinct full chunks of {num_full}")

    def copy_views(
        self, plan: ArenaPlan, source_keys: torch.Tensor, source_values: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Take ``plan``, made by this arena or another holding the same chunks (a session's arenas of the other
        decoder layers), from the sources' keys and values [length, kv_heads, hd]; the copies it needs, as
        (targets, sources) [chunk, kv_heads, hd] views for the caller to make in one multi-tensor copy with the
        batch's others. No copy reads what another writes: stragglers move from at or past the new end to free
        slots below it, and entering chunks go to the other free slots."""
        self.slot_chunk = plan.slot_chunk
        num_full = source_keys.shape[0] // self.chunk_size
        chunked = [source[: num_full * self.chunk_size].unflatten(0, (num_full, self.chunk_size))
                   for source in (source_keys, source_values)]  # fmt: skip
        targets, sources = [], []
        for arena, source in zip((self.keys, self.values), chunked):
            targets += [arena[slot] for slot in (*plan.move_to, *plan.enter_slots)]
            sources += [arena[slot] for slot in plan.move_from] + [source[chunk] for chunk in plan.enter_chunks]
        self.copies += len(plan.move_from) + len(plan.enter_chunks)
        return targets, sources

    def restage(
        self, chunks: list[int], chunks_on_device: torch.Tensor, source_keys: torch.Tensor,
        source_values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    ) -> None:  # fmt: skip
        """Hold ``chunks`` (ascending full chunks of the sources [length, kv_heads, hd]; ``chunks_on_device`` the
        same ids, [n] int64 uploaded by the caller) in slots 0, 1, ..., each slot's keys rotated by cos, sin
        [n * chunk, hd] (``compacted_shifts``' positions)."""
        size, used, num_full = self.chunk_size, len(chunks), source_keys.shape[0] // self.chunk_size
        self._check_selection(chunks, num_full)
        full = num_full * size
        keys = source_keys[:full].unflatten(0, (-1, size)).index_select(0, chunks_on_device).flatten(0, 1)
        self.keys[:used].copy_(self.rotate(keys, cos, sin).unflatten(0, (used, size)))
        self.values[:used].copy_(source_values[:full].unflatten(0, (-1, size)).index_select(0, chunks_on_device))
        self.slot_chunk = list(chunks)
        self.copies += used

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_used * chunk, kv_heads, hd] keys and values of the working set's chunks, in slot order."""
        used = len(self.slot_chunk)
        return self.keys[:used].flatten(0, 1), self.values[:used].flatten(0, 1)


def compacted_shifts(chunks: list[int], chunk_size: int) -> list[int]:
    """Per chunk of ``chunks`` (ascending), how far its positions move when the chunks follow one another up to
    the last, which stays: 0 for the last and for any run of chunks that already ends there, and for an earlier
    chunk the distance it moves up (positive)."""
    last = chunks[-1]
    return [(last - (len(chunks) - 1 - i) - chunk) * chunk_size for i, chunk in enumerate(chunks)]

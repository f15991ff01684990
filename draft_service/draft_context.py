"""What the draft attends to: every committed entry (EAGLE-3 baseline) or the salience working set.

The full draft KV is always kept, one per decoder layer (chunks may re-enter the working set
later); with salience on, attention reads only the chunk arena (sinks, recent chunks,
best-scoring chunks) plus the partial tail chunk, so a draft step costs O(budget) instead of
O(context). A context whose full chunks all fit the arena would select every chunk anyway: it
attends to the whole KV directly, and its chunks are neither scored nor staged until it outgrows
the budget.

Layers. Chunks are scored on the last decoder layer's keys against its query of the newest entry
(the root's query, which an accept keeps anyway); every layer attends to the chosen chunks, each
from an arena of its own that takes the same selections.

When. A prompt's working set is chosen at once (``refresh_all(..., wait=True)``). An accept's choice
is only queued (``Drafter.rescore``), once the device has other work to hide it behind: after the next
proposal's launch, or, where entries are written on the device, after the next verify's launch, so its host
work never sits between one verify's results and the next verify's launch. The device ranks the chunks and
copies the best to the host behind that work, and the context takes the new working set at its next accept
(or device write), when the copy is long done. The proposals in between attend to the set chosen a step or
two earlier, and the tail past the chunks that set chose among grows to hold the newer tokens, so nothing
committed is left out. So no step waits for the device to choose chunks.

Batches. An accept's salience work is a constant number of launches and host passes for the whole
batch: the chunks that filled are encoded together, every context's chunks are scored in one launch
from a pool of encodings shared by the drafter's sessions (``chunk_encoding``), one launch ranks every
context's chunks and only the best few dozen ids of each come to the host in one copy, the host keeps or
replaces each set on those ints (``working_set``), and the arenas whose set changed are copied in one
multi-tensor copy between them. A single context is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from diffspec.devices import HostCopy
from draft_service.chunk_arena import ChunkArena, compacted_shifts
from draft_service.chunk_encoding import ChunkEncodingPool, ChunkIndex
from draft_service.draft_kv import DraftKV
from draft_service.working_set import (
    WorkingSetConfig,
    WorkingSetSelector,
    choose_candidates,
    forced_counts,
    select_working_sets,
)


Rope = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [n] int64 -> cos, sin [n, hd]


@dataclass(frozen=True)
class QueuedCandidates:
    """A batch's ranked chunks on their way to the host: the next working sets of its contexts."""

    copy: HostCopy  # of [contexts, RANKED_AT + ranked] int64 ``choose_candidates``
    num_chunks: np.ndarray  # [contexts] full chunks each context's row scored


class DraftContext:
    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        salience: WorkingSetConfig | None = None,
        num_layers: int = 1,
        chunk_pool: ChunkEncodingPool | None = None,
        rope: Rope | None = None,
    ) -> None:
        """``chunk_pool``: where the chunk encodings live, shared by the drafter's sessions of the same chunk size
        so that a batch is scored in one launch (None: a pool of its own). ``rope``: the head's cos/sin of positions,
        which a working set with ``compact_positions`` rotates its chunks' keys by."""
        if salience is not None and salience.compact_positions and rope is None:
            raise ValueError("a working set with compacted positions needs the head's rope")
        self.kvs = [DraftKV(num_kv_heads, head_dim, dtype, device) for _ in range(num_layers)]  # per decoder layer
        self.salience = salience
        self.rope = rope
        if salience is not None:
            size = salience.chunk_size
            pool = chunk_pool or ChunkEncodingPool(size, num_kv_heads, head_dim, dtype, device)
            if pool.chunk_size != size or pool.key_min.shape[2:] != (num_kv_heads, head_dim):
                raise ValueError(f"a pool of {pool.chunk_size}-token chunks of {tuple(pool.key_min.shape[2:])}")
            self.index = ChunkIndex(pool)
            self.selector = WorkingSetSelector(salience)
            shape = (salience.max_chunks, salience.chunk_size, num_kv_heads, head_dim)
            self.arenas = [ChunkArena(*shape, dtype, device) for _ in range(num_layers)]  # per layer
        self.covered_chunks = 0  # full chunks the applied working set was chosen among: the tail starts after them
        self.working_set_updates = 0  # times the working set changed (every layer's arena updated)
        self._queued: tuple[QueuedCandidates, int] | None = None  # a batch's choice on its way to the host; the row

    @property
    def length(self) -> int:
        return self.kvs[0].length

    def claim(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next ``n`` committed positions' keys and values [n, kv_heads, hd] of each decoder layer, for the
        caller to fill before the next ``refresh_all``."""
        return [kv.claim(n) for kv in self.kvs]

    def keep(self, length: int) -> None:
        """Every layer's committed positions cut back to ``length`` (``DraftKV.keep``)."""
        for kv in self.kvs:
            kv.keep(length)

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s keys and values [length, kv_heads, hd] of every committed position."""
        return self.kvs[layer].view()

    @property
    def selects(self) -> bool:
        """Whether a working set is chosen: salience is on and the full chunks outnumber the arena's slots."""
        return self.salience is not None and self.length // self.salience.chunk_size > self.salience.max_chunks

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s keys and values [tokens, kv_heads, hd] the draft attends to."""
        spans = self.spans(layer)
        if len(spans) == 1:
            return spans[0]
        return torch.cat([k for k, _ in spans]), torch.cat([v for _, v in spans])

    def spans(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What ``view`` returns, as contiguous pieces in order (the arena, then the partial tail chunk),
        so a batch can copy them without concatenating first."""
        keys, values = self.kvs[layer].view()
        if not self.selects:
            return [(keys, values)]
        tail = self.covered_chunks * self.salience.chunk_size
        return [self.arenas[layer].view(), (keys[tail:], values[tail:])]

    @property
    def attended_tokens(self) -> int:
        """The entries ``view`` holds, counted without building it (a proposal's plan reads it every step)."""
        if not self.selects:
            return self.length
        staged = len(self.arenas[0].slot_chunk) * self.salience.chunk_size
        return staged + self.length - self.covered_chunks * self.salience.chunk_size

    @property
    def min_staged_tokens(self) -> int:
        """Keys a proposal stages for it at least: with salience the whole budget, which it never attends past,
        so a salience session's proposal shape does not change as its context grows."""
        return self.salience.budget_tokens if self.salience is not None else 0


def copy_contexts(contexts: list[DraftContext], keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
    """Context b's attended keys and values of decoder layer l into the first rows of ``keys_out[l, b]`` and
    ``values_out[l, b]`` ([layers, batch, capacity, kv_heads, hd]): one multi-tensor copy for the whole batch,
    not two per session and layer."""
    targets, sources = [], []
    for layer in range(keys_out.shape[0]):
        for b, context in enumerate(contexts):
            offset = 0
            for keys, values in context.spans(layer):
                n = keys.shape[0]
                targets += [keys_out[layer, b, offset : offset + n], values_out[layer, b, offset : offset + n]]
                sources += [keys, values]
                offset += n
    torch._foreach_copy_(targets, sources)


def refresh_all(contexts: list[DraftContext], queries: torch.Tensor, wait: bool) -> None:
    """Re-score every salience context against its last layer's latest query (``queries`` [B, heads, hd]): the
    chunks that filled encoded, then all contexts sharing an encoding pool (all of a drafter's, normally) scored
    in one launch, their chunks ranked on the device and the best copied to the host in one copy. The selection
    ends on the host: with ``wait`` now (a prompt's first working set), else at each context's next accept
    (``take_queued_selections``), so an accept never waits."""
    selecting = [i for i, context in enumerate(contexts) if context.selects]
    by_pool: dict[int, list[int]] = {}
    for i in selecting:
        by_pool.setdefault(id(contexts[i].index.pool), []).append(i)
    for rows in by_pool.values():
        group = [contexts[i] for i in rows]
        indexes = [context.index for context in group]
        pool = indexes[0].pool
        keys, lengths = [context.kvs[-1].keys for context in group], [context.length for context in group]
        some = rows if len(rows) < queries.shape[0] else None  # some contexts attend to everything: rows left out
        configs = [context.salience for context in group]
        scored = pool.encode_and_score(indexes, keys, lengths, queries, some, along=forced_counts(configs))
        most = max(c.max_chunks for c in configs)  # chunks any row may choose by score
        ranked = choose_candidates(scored.scores, scored.num_chunks, scored.along, most)
        queued = QueuedCandidates(HostCopy(ranked), np.array([index.num_chunks for index in indexes]))
        for row, context in enumerate(group):
            context._queued = (queued, row)
    if wait:
        take_queued_selections(contexts)


def take_queued_selections(contexts: list[DraftContext]) -> None:
    """Choose each context's working set from the candidates the last accept queued (their copy is done by now):
    one selection for the contexts of each queued batch."""
    batches: dict[int, list[DraftContext]] = {}
    for context in contexts:
        if context._queued is not None:
            batches.setdefault(id(context._queued[0]), []).append(context)
    for group in batches.values():
        queued = group[0]._queued[0]
        rows = [context._queued[1] for context in group]
        for context in group:
            context._queued = None
        reselect_all(group, queued.copy.get().numpy()[rows], queued.num_chunks[rows])


def reselect_all(contexts: list[DraftContext], candidates: np.ndarray, num_chunks: np.ndarray) -> None:
    """Each context's working set for its row of host ``candidates`` [contexts, RANKED_AT + ranked]
    (``choose_candidates`` of its num_chunks[i] [contexts] full chunks); the arenas of every context whose set
    changed follow, in one multi-tensor copy."""
    selections = select_working_sets([context.selector for context in contexts], candidates, num_chunks)
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for context, selected in zip(contexts, selections):
        if set(selected) == context.arenas[0].chunks():
            continue
        if context.salience.compact_positions:
            restage_compacted(context, selected)
            continue
        plan = context.arenas[0].plan(selected, context.length // context.salience.chunk_size)
        for arena, kv in zip(context.arenas, context.kvs):
            to, of = arena.copy_views(plan, *kv.view())
            targets += to
            sources += of
        context.working_set_updates += 1
    if targets:
        torch._foreach_copy_(targets, sources)  # every changed arena of the batch, every layer: a few launches
    for context, n in zip(contexts, num_chunks):
        context.covered_chunks = int(n)


def restage_compacted(context: DraftContext, selected: list[int]) -> None:
    """Every layer's arena restaged with ``selected`` in position order, their keys rotated so that the chunks
    follow one another up to the newest (``ChunkArena.restage``)."""
    chunks, size = sorted(selected), context.salience.chunk_size
    # one staged upload, no stream sync: this runs while a verify may still be on the device
    uploaded = context.index.pool.staging.upload(chunks, compacted_shifts(chunks, size))
    on_device, shifts = uploaded.split(len(chunks))
    cos, sin = context.rope(shifts.repeat_interleave(size))  # [chunks * size, hd]: one shift per chunk's rows
    for arena, kv in zip(context.arenas, context.kvs):
        arena.restage(chunks, on_device, *kv.view(), cos, sin)
    context.working_set_updates += 1

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

When. A prompt's working set is chosen at once (``refresh_all(..., wait=True)``). An accept's scores
are only queued: their host copy runs behind the accept, and the context takes the new working set
at its next accept, when the copy is long done. The proposal in between attends to the set chosen a
step earlier, and the tail past the chunks that set chose among grows to hold the newer tokens, so
nothing committed is left out. So no step waits for the device to choose chunks.
"""

from __future__ import annotations

import itertools

import torch

from diffspec.devices import HostCopy, PinnedStaging
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
        num_layers: int = 1,
        staging: PinnedStaging | None = None,
    ) -> None:
        """``staging``: the drafter's ring of pinned upload buffers, which the arenas' updates share."""
        self.kvs = [DraftKV(num_kv_heads, head_dim, dtype, device) for _ in range(num_layers)]  # per decoder layer
        self.salience = salience
        if salience is not None:
            self.index = ChunkIndex(salience.chunk_size, num_kv_heads, head_dim, dtype, device)
            self.selector = WorkingSetSelector(salience)
            shape = (salience.max_chunks, salience.chunk_size, num_kv_heads, head_dim)
            self.arenas = [ChunkArena(*shape, dtype, device, staging) for _ in range(num_layers)]  # per decoder layer
        self.covered_chunks = 0  # full chunks the applied working set was chosen among: the tail starts after them
        self.working_set_updates = 0  # times the working set changed (every layer's arena updated)
        self._queued: tuple[HostCopy, slice] | None = None  # a batch's scores on their way to the host; this one's

    @property
    def length(self) -> int:
        return self.kvs[0].length

    def claim(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next ``n`` committed positions' keys and values [n, kv_heads, hd] of each decoder layer, for the
        caller to fill before the next ``refresh``."""
        return [kv.claim(n) for kv in self.kvs]

    def committed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``layer``'s keys and values [length, kv_heads, hd] of every committed position."""
        return self.kvs[layer].view()

    @property
    def selects(self) -> bool:
        """Whether a working set is chosen: salience is on and the full chunks outnumber the arena's slots."""
        return self.salience is not None and self.length // self.salience.chunk_size > self.salience.max_chunks

    def refresh(self, q: torch.Tensor) -> None:
        """Re-score chunks against the last layer's latest query [heads, hd] and update the arenas if needed."""
        refresh_all([self], q[None], wait=True)

    def chunk_scores(self, q: torch.Tensor) -> torch.Tensor:
        """[num_chunks] float32 chunk scores of the last layer's keys for its latest query [heads, hd], on the
        device."""
        self.index.update(self.kvs[-1].view()[0])
        return self.index.scores(q)

    def reselect(self, scores: torch.Tensor) -> None:
        """The working set for host ``scores`` [num_chunks] (one per full chunk); every layer's arena follows
        when it changed."""
        assert self.salience is not None
        selected = self.selector.select(scores)
        if set(selected) != self.arenas[0].chunks():
            for arena, kv in zip(self.arenas, self.kvs):
                arena.update(selected, *kv.view())
            self.working_set_updates += 1
        self.covered_chunks = scores.numel()

    def queue_selection(self, copy: HostCopy, rows: slice) -> None:
        """Scores [num_chunks] on their way to the host, at ``rows`` of ``copy``: the next working set."""
        self._queued = (copy, rows)

    def take_queued_selection(self) -> None:
        """Choose the working set from the scores the last accept queued (their copy is done by now)."""
        if self._queued is not None:
            copy, rows = self._queued
            self._queued = None
            self.reselect(copy.get()[rows])

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
        return sum(keys.shape[0] for keys, _ in self.spans(0))

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
    """Re-score every salience context against its last layer's latest query (``queries`` [B, heads, hd]). The
    selection runs on the host, from one copy of all contexts' scores: with ``wait`` now (a prompt's first
    working set), else at each context's next accept (``take_queued_selection``), so an accept never waits."""
    scored = [(c, c.chunk_scores(q)) for c, q in zip(contexts, queries) if c.selects]
    if not scored:
        return
    copy = HostCopy(torch.cat([scores for _, scores in scored]))
    bounds = [0, *itertools.accumulate(s.numel() for _, s in scored)]
    for (context, _), lo, hi in zip(scored, bounds, bounds[1:]):
        context.queue_selection(copy, slice(lo, hi))
        if wait:
            context.take_queued_selection()

"""Which chunks the draft attends to: sinks, the recent window, and the best-scoring rest.

The working set is the first ``sink_chunks`` chunks (attention sinks), the last
``recent_chunks`` full chunks plus the partial tail (the local window), and as many of the
remaining chunks as the token budget allows, best chunk score first. Scores are cheap
(one bound per chunk), so they are computed every step; the selection changes only every
``reselect_every`` steps or when the fresh top set overlaps the current one by less than
``min_overlap`` (the text has moved on), so the arena is not churned by noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WorkingSetConfig:
    chunk_size: int = 64  # tokens per chunk
    budget_tokens: int = 2048  # tokens attended at most: selected chunks + the tail since they were chosen
    sink_chunks: int = 1
    recent_chunks: int = 4
    reselect_every: int = 8  # steps between scheduled re-selections
    min_overlap: float = 0.75  # re-select early when the top set drifts below this overlap

    @property
    def max_chunks(self) -> int:
        """Chunks that fit the budget next to the tail: up to one partial chunk, plus the tokens of the accept
        whose scores choose the next set (at most a tree's depth + 1, under a chunk: ``draft_context``)."""
        return max(1, self.budget_tokens // self.chunk_size - 2)


class WorkingSetSelector:
    """Per-session selection state: the chosen scored chunks and when they were chosen."""

    def __init__(self, config: WorkingSetConfig) -> None:
        self.config = config
        self.scored: list[int] = []  # chunks chosen by score (not sinks or recent)
        self.steps_since = 0

    def select(self, scores: torch.Tensor) -> list[int]:
        """All chunk ids of the working set, ascending, for host scores [num_chunks]. On the host's arrays, not
        torch's: a dozen small tensor ops cost more per session and accept than the choice itself."""
        c, values = self.config, scores.numpy()
        n = values.size
        forced = sorted(set(range(min(c.sink_chunks, n))) | set(range(max(0, n - c.recent_chunks), n)))
        room = max(0, c.max_chunks - len(forced))
        candidates = values.astype(np.float64)  # a copy
        candidates[forced] = -np.inf
        eligible = np.flatnonzero(np.isfinite(candidates))
        best_first = eligible[np.argsort(-candidates[eligible], kind="stable")]  # ties: the earlier chunk
        fresh = sorted(best_first[:room].tolist())
        self.steps_since += 1
        kept = [chunk for chunk in self.scored if chunk not in forced][:room]
        overlap = len(set(fresh) & set(kept)) / max(1, len(fresh))
        if self.steps_since >= c.reselect_every or overlap < c.min_overlap or len(kept) < len(fresh):
            kept = fresh
            self.steps_since = 0
        self.scored = kept
        return sorted(set(forced) | set(kept))

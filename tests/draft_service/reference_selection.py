"""The per-session working-set rule the batched selection replaced, kept as its test oracle: one session,
its chunk lists in Python; and ``select_alone``, one session through the batched rule, for the tests of what
the rule chooses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from draft_service.working_set import WorkingSetConfig, WorkingSetSelector, select_working_sets


@dataclass
class ReferenceSelector:
    config: WorkingSetConfig
    scored: list[int] = field(default_factory=list)  # chunks chosen by score (not sinks or recent)
    steps_since: int = 0

    def select(self, values: np.ndarray) -> list[int]:
        """All chunk ids of the working set, ascending, for host scores [num_chunks]."""
        c, n = self.config, values.size
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


def select_alone(selector: WorkingSetSelector, scores: np.ndarray) -> list[int]:
    """``selector``'s working set for host scores [num_chunks]: a batch of one row, as wide as its chunks."""
    return select_working_sets([selector], scores[None], np.array([scores.size]))[0]

"""The per-session working-set rule the batched selection replaced, kept as its test oracle: one session,
its chunk lists in Python; and the batched rule on host scores (``select_batch``, ``select_alone``), its
device part run on CPU tensors, for the tests of what the rule chooses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.working_set import (
    WorkingSetConfig,
    WorkingSetSelector,
    choose_candidates,
    forced_counts,
    select_working_sets,
)


@dataclass
class ReferenceSelector:
    config: WorkingSetConfig
    scored: list[int] = field(default_factory=list)  # chunks chosen by score (not sinks or recent)
    steps_since: int = 0

    def forced(self, n: int) -> list[int]:
        """The sinks and the recent chunks of ``n`` chunks, ascending."""
        c = self.config
        return sorted(set(range(min(c.sink_chunks, n))) | set(range(max(0, n - c.recent_chunks), n)))

    def room(self, n: int) -> int:
        """Chunks chosen by score at most, next to the forced ones of ``n`` chunks."""
        return max(0, self.config.max_chunks - len(self.forced(n)))

    def best_first(self, values: np.ndarray) -> list[int]:
        """The eligible chunks of host scores [num_chunks] (finite, not forced), best first, ties to the earlier."""
        candidates = values.astype(np.float64)  # a copy
        candidates[self.forced(values.size)] = -np.inf
        eligible = np.flatnonzero(np.isfinite(candidates))
        return eligible[np.argsort(-candidates[eligible], kind="stable")].tolist()

    def select(self, values: np.ndarray) -> list[int]:
        """All chunk ids of the working set, ascending, for host scores [num_chunks]."""
        c, n = self.config, values.size
        forced, room = self.forced(n), self.room(n)
        fresh = sorted(self.best_first(values)[:room])
        self.steps_since += 1
        kept = [chunk for chunk in self.scored if chunk not in forced][:room]
        overlap = len(set(fresh) & set(kept)) / max(1, len(fresh))
        if self.steps_since >= c.reselect_every or overlap < c.min_overlap or len(kept) < len(fresh):
            kept = fresh
            self.steps_since = 0
        self.scored = kept
        return sorted(set(forced) | set(kept))


def candidates_on_cpu(configs: list[WorkingSetConfig], scores: np.ndarray, num_chunks: np.ndarray) -> np.ndarray:
    """``choose_candidates`` [rows, RANKED_AT + ranked] of host scores [rows, width], on CPU tensors (the same
    torch ops a GPU runs)."""
    forced = torch.tensor(forced_counts(configs), dtype=torch.int64)
    most = max((c.max_chunks for c in configs), default=0)
    scores_up = torch.from_numpy(np.ascontiguousarray(scores))
    return choose_candidates(scores_up, torch.as_tensor(num_chunks, dtype=torch.int64), forced, most).numpy()


def select_batch(selectors: list[WorkingSetSelector], scores: np.ndarray, num_chunks: np.ndarray) -> list[list[int]]:
    """Each selector's working set for its row of host scores [rows, width] (row i's first num_chunks[i] [rows]
    score its chunks): the device part on CPU tensors, then the host part."""
    num_chunks = np.asarray(num_chunks, dtype=np.int64)
    candidates = candidates_on_cpu([s.config for s in selectors], scores, num_chunks)
    return select_working_sets(selectors, candidates, num_chunks)


def select_alone(selector: WorkingSetSelector, scores: np.ndarray) -> list[int]:
    """``selector``'s working set for host scores [num_chunks]: a batch of one row, as wide as its chunks."""
    return select_batch([selector], scores[None], np.array([scores.size]))[0]

"""Which chunks the draft attends to: sinks, the recent window, and the best-scoring rest.

The working set is the first ``sink_chunks`` chunks (attention sinks), the last
``recent_chunks`` full chunks plus the partial tail (the local window), and as many of the
remaining chunks as the token budget allows, best chunk score first. Scores are cheap
(one bound per chunk), so they are computed every step; the selection changes only every
``reselect_every`` steps or when the fresh top set overlaps the current one by less than
``min_overlap`` (the text has moved on), so the arena is not churned by noise. A batch's
sessions are selected together (``select_working_sets``), one session as a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
    """Per-session selection state: the chosen scored chunks and when they were chosen (``select_working_sets``
    moves it on)."""

    def __init__(self, config: WorkingSetConfig) -> None:
        self.config = config
        self.scored = np.empty(0, dtype=np.int64)  # [chosen] chunks chosen by score (not sinks or recent)
        self.steps_since = 0


def select_working_sets(
    selectors: list[WorkingSetSelector],
    scores: np.ndarray,  # [len(selectors), width] host scores; row i's first num_chunks[i] are its chunks'
    num_chunks: np.ndarray,  # [len(selectors)] chunks of each row
) -> list[list[int]]:
    """Each selector's working set (all its chunk ids, ascending) for its row of ``scores``; its state moves
    on. The rule runs on the host's arrays for every row at once, each row with its own config, in passes over
    the whole array and a few small ops a row: a pass over a row's chunks, or a sort of them, would cost more
    per accept than the choice itself."""
    rows, width = scores.shape
    configs = [s.config for s in selectors]
    sink, recent, max_chunks, every = np.array(
        [(c.sink_chunks, c.recent_chunks, c.max_chunks, c.reselect_every) for c in configs], dtype=np.int64
    ).reshape(rows, 4).T  # each [rows]
    n = np.asarray(num_chunks, dtype=np.int64)
    # the forced chunks: the sinks [0, sinks_end) and the recent ones [recent_start, n), which may overlap
    sinks_end, recent_start = np.minimum(sink, n), np.maximum(0, n - recent)
    room = np.maximum(0, max_chunks - sinks_end - (n - recent_start) + np.maximum(0, sinks_end - recent_start))

    def forced(chunks: np.ndarray) -> np.ndarray:
        """Whether chunks [rows, k] are sinks or recent chunks of their row."""
        return (chunks < n[:, None]) & ((chunks < sink[:, None]) | (chunks >= recent_start[:, None]))

    chunks = np.arange(width)[None]  # [1, width]
    candidates = np.where(np.isfinite(scores) & (chunks < n[:, None]) & ~forced(chunks), scores, -np.inf)
    is_fresh = _largest(candidates, np.minimum(room, np.isfinite(candidates).sum(1)))  # [rows, width]
    num_fresh = is_fresh.sum(1)
    held = np.full((rows, max((s.scored.size for s in selectors), default=0)), -1, dtype=np.int64)  # [rows, held]
    for row, selector in zip(held, selectors):
        row[: selector.scored.size] = selector.scored
    kept = (held >= 0) & ~forced(held)
    kept &= np.cumsum(kept, axis=1) <= room[:, None]  # the first ``room`` chunks still scored-only
    kept_fresh = np.zeros_like(kept)
    looked_up = kept & (held < width)
    kept_fresh[looked_up] = is_fresh[np.nonzero(looked_up)[0], held[looked_up]]
    steps = np.array([s.steps_since for s in selectors], dtype=np.int64) + 1
    min_overlap = np.array([c.min_overlap for c in configs], dtype=np.float64)
    overlap = kept_fresh.sum(1) / np.maximum(1, num_fresh)
    again = (steps >= every) | (overlap < min_overlap) | (kept.sum(1) < num_fresh)
    scored = np.zeros((rows, max(width, int(held.max(initial=-1)) + 1)), dtype=bool)  # [rows, chunks] chosen by score
    scored[:, :width] = is_fresh & again[:, None]
    stays = kept & ~again[:, None]
    scored[np.nonzero(stays)[0], held[stays]] = True
    selected = scored.copy()
    selected[:, :width] |= forced(chunks)
    for i, selector in enumerate(selectors):  # ascending ids: a set kept in part stays in order
        selector.scored = np.flatnonzero(scored[i])
        selector.steps_since = 0 if again[i] else int(steps[i])
    return [np.flatnonzero(row).tolist() for row in selected]


def _largest(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[rows, width] whether each of ``values`` [rows, width] is among the counts[i] [rows] largest of its row,
    ties to the earlier entry (as a stable sort takes them): one partition of the array, not a sort of each row."""
    most = int(counts.max(initial=0))
    if most == 0:
        return np.zeros(values.shape, dtype=bool)
    largest = -np.sort(np.partition(-values, most - 1, axis=1)[:, :most], axis=1)  # [rows, most] descending
    last = np.where(counts > 0, largest[np.arange(len(values)), np.maximum(counts - 1, 0)], np.inf)[:, None]
    above, tied = values > last, values == last
    return above | (tied & (np.cumsum(tied, axis=1) <= (counts - above.sum(1))[:, None]))

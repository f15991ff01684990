"""Which chunks the draft attends to: sinks, the recent window, and the best-scoring rest.

The working set is the first ``sink_chunks`` chunks (attention sinks), the last
``recent_chunks`` full chunks plus the partial tail (the local window), and as many of the
remaining chunks as the token budget allows, best chunk score first. Scores are cheap
(one bound per chunk), so they are computed every step; the selection changes only every
``reselect_every`` steps or when the fresh top set overlaps the current one by less than
``min_overlap`` (the text has moved on), so the arena is not churned by noise.

A batch's sessions are selected together, one session as a batch of one, in two parts. The
device ranks every row's candidates where the scores are (``choose_candidates``, one launch), and only the
best few dozen of a row's thousand chunk ids come to the host; the host keeps or replaces each
set on those ints (``select_working_sets``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from diffspec_kernels.candidate_rank_ref import RANKED_AT, rank_candidates_reference
from diffspec_kernels.dispatch import triton_kernels_on


@dataclass(frozen=True)
class WorkingSetConfig:
    chunk_size: int = 64  # tokens per chunk
    budget_tokens: int = 2048  # tokens attended at most: selected chunks + the tail since they were chosen
    sink_chunks: int = 1
    recent_chunks: int = 4
    reselect_every: int = 8  # steps between scheduled re-selections
    min_overlap: float = 0.75  # re-select early when the top set drifts below this overlap
    # the chosen chunks' keys re-roped to follow one another up to the newest chosen chunk, which keeps its own
    # positions (``ChunkArena.restage``): the head sees a working set of ~budget_tokens as a context that long
    compact_positions: bool = False

    def fitting(self) -> WorkingSetConfig:
        """This config, when its arena holds the sink and recent chunks the rule always chooses (serving stages
        every chosen chunk); a ValueError saying what would fit otherwise."""
        forced = self.sink_chunks + self.recent_chunks
        if self.max_chunks < forced:
            raise ValueError(
                f"a working set of {self.budget_tokens} tokens has room for {self.max_chunks} chunks of {self.chunk_size} "
                f"beside its tail, fewer than its {self.sink_chunks} sink and {self.recent_chunks} recent chunks: it "
                f"needs at least {(forced + 2) * self.chunk_size} tokens, or fewer recent ones"
            )
        return self

    @staticmethod
    def of_tokens(chunk_size: int, budget_tokens: int, recent_tokens: int, **rest: float | bool) -> WorkingSetConfig:
        """The config of settings that count tokens (``working_set_tokens``, ``salience_recent_tokens``).

        ``recent_tokens`` 0 gives the recent window three quarters of the budget, or as many chunks as fit
        beside the sinks when that is fewer: the head was trained on short windows and drafts best from the text
        just before it (bench-code at 64K, 2,048 tokens: tau grows with the window up to 1,536 recent tokens,
        +10% over 256, and a quarter left to the best-scoring chunks costs at most 1% against a window of the
        whole budget; at 4K all agree within 1%: bench/RESULTS.md)."""
        config = WorkingSetConfig(chunk_size, budget_tokens, **rest)
        if recent_tokens:
            recent_chunks = max(1, recent_tokens // chunk_size)
        else:
            recent_chunks = max(1, min(budget_tokens * 3 // 4 // chunk_size, config.max_chunks - config.sink_chunks))
        return replace(config, recent_chunks=recent_chunks)

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
        self.scored: list[int] = []  # [chosen] chunks chosen by score (not sinks or recent), ascending
        self.steps_since = 0


def forced_counts(configs: list[WorkingSetConfig]) -> list[int]:
    """What ``choose_candidates`` needs of the rows' configs: each row's sink_chunks, then each row's
    recent_chunks (host ints, for the upload the scoring makes anyway)."""
    return [*(c.sink_chunks for c in configs), *(c.recent_chunks for c in configs)]


def choose_candidates(
    scores: torch.Tensor,  # [rows, width] float32; row i's first num_chunks[i] score its chunks
    num_chunks: torch.Tensor,  # [rows] int64
    forced: torch.Tensor,  # [2 * rows] int64 ``forced_counts`` of the rows' configs
    max_ranked: int,  # chunks a row may choose by score at most: the rows' largest max_chunks
) -> torch.Tensor:
    """[rows, RANKED_AT + min(max_ranked, width)] int64, per row: where its sinks end and its recent chunks
    start, how many chunks are eligible, then its chunks best first, so that its first k eligible are the
    rule's k best (``diffspec_kernels/candidate_rank_ref.py``). One launch on a GPU, no sync: the host copies
    this, not the scores."""
    if not triton_kernels_on(scores.device):
        return rank_candidates_reference(scores, num_chunks, forced, max_ranked)
    from diffspec_kernels.candidate_rank_triton import rank_candidates_triton

    return rank_candidates_triton(scores, num_chunks, forced, max_ranked)


def select_working_sets(
    selectors: list[WorkingSetSelector],
    candidates: np.ndarray,  # [len(selectors), RANKED_AT + ranked] host ``choose_candidates`` of their rows
    num_chunks: np.ndarray,  # [len(selectors)] chunks of each row
) -> list[list[int]]:
    """Each selector's working set (all its chunk ids, ascending) for its row of ``candidates``; its state moves
    on. The fresh set is the row's first ``room`` eligible candidates; it replaces the chunks kept when a
    re-selection is due, when fewer than it are kept, or when too few of the kept are in it. A few dozen ints a
    row, so plain Python: a numpy call costs microseconds whatever its size."""
    selections = []
    for selector, row, n in zip(selectors, candidates.tolist(), num_chunks.tolist()):
        config = selector.config
        sinks_end, recent_start, eligible, ranked = *row[:RANKED_AT], row[RANKED_AT:]
        past_sinks = max(sinks_end, recent_start)  # the forced chunks: [0, sinks_end) and [past_sinks, n)
        room = max(0, config.max_chunks - sinks_end - (n - past_sinks))
        fresh = ranked[: min(room, eligible)]
        kept = [c for c in selector.scored if c >= n or sinks_end <= c < recent_start][:room]  # not forced now
        steps = selector.steps_since + 1
        overlap = len(set(fresh).intersection(kept)) / max(1, len(fresh))
        if steps >= config.reselect_every or overlap < config.min_overlap or len(kept) < len(fresh):
            kept, steps = sorted(fresh), 0
        selector.scored, selector.steps_since = kept, steps
        selections.append(sorted([*range(sinks_end), *kept, *range(past_sinks, n)]))  # disjoint: kept not forced
    return selections

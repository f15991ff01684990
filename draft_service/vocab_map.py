"""EAGLE-3 draft vocabulary: the most frequent target tokens of the training data.

The head's lm_head scores only these ids (a 4x smaller softmax for Llama-3's 128K vocab);
``d2t`` maps a draft id back to its target id and ``t2d`` marks the target ids it covers.
"""

from __future__ import annotations

import torch


def build_vocab_map(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_counts [vocab] -> (d2t int64 [draft_vocab], t2d bool [vocab]).

    Draft vocab = the ``draft_vocab_size`` most frequent ids (ties to the lower id), sorted
    ascending; ``d2t[i] = used[i] - i`` so ``target_id = draft_id + d2t[draft_id]``.
    """
    vocab = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} outside 1..{vocab}")
    by_count = torch.sort(token_counts.cpu(), descending=True, stable=True).indices
    used = by_count[:draft_vocab_size].sort().values  # [draft_vocab] target ids, ascending
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def target_to_draft_index(t2d: torch.Tensor) -> torch.Tensor:
    """t2d bool [vocab] -> int64 [vocab]: the draft id of each target id, -1 where it has none."""
    index = torch.full(t2d.shape, -1, dtype=torch.int64, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return index

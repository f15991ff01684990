"""Each row's best children in the draft vocabulary: log-softmax, top-k and the map to target ids, in PyTorch.

The CPU path and the oracle for ``diffspec_kernels.top_children_triton``.
"""

from __future__ import annotations

import torch


def top_children_reference(
    logits: torch.Tensor,  # [rows, vocab] in the head's dtype
    k: int,
    target_ids: torch.Tensor,  # [vocab] int64: the target id of each draft id
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, k] float32 log-probs, best first; [rows, k] int64 target ids
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    # a stable sort, not topk: exact ties go to the lower draft id whatever k is (topk's order among ties
    # depends on k, and a proposal padded to more children than a plan keeps must pick the same ones)
    values, ids = log_probs.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], target_ids[ids[..., :k]]

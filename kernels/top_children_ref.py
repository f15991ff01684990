"""Each row's best children in the draft vocabulary: log-softmax, top-k and the map to target ids, in PyTorch.

The CPU path and the oracle for ``kernels.top_children_triton``.
"""

from __future__ import annotations

import torch


def top_children_reference(
    logits: torch.Tensor,  # [rows, vocab] in the head's dtype
    k: int,
    target_ids: torch.Tensor,  # [vocab] int64: the target id of each draft id
) -> tuple[torch.Tensor, torch.Tensor]:  # [rows, k] float32 log-probs, best first; [rows, k] int64 target ids
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    top_log_probs, top_ids = log_probs.topk(k, dim=-1)
    return top_log_probs, target_ids[top_ids]

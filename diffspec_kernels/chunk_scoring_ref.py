"""Chunk scoring for salience selection (PyTorch reference; the CPU path and the Triton oracle).

Each chunk of draft keys is summarised per KV head by its element-wise min and max key. For a
query q, sum_i max(q_i * kmax_i, q_i * kmin_i) bounds q . k from above for every key k in the
chunk (Quest's bound), so a chunk that could hold a high-attention key never scores low. A
chunk's score is the largest bound over all query heads.
"""

from __future__ import annotations

import torch


def chunk_scores_reference(
    q: torch.Tensor,  # [num_heads, head_dim] current draft queries
    key_min: torch.Tensor,  # [num_chunks, num_kv_heads, head_dim]
    key_max: torch.Tensor,  # [num_chunks, num_kv_heads, head_dim]
) -> torch.Tensor:  # [num_chunks] float32
    group = q.shape[0] // key_min.shape[1]
    qf = q.float().view(key_min.shape[1], group, -1)  # [kv_heads, group, hd]
    low = torch.einsum("kgd,ckd->ckgd", qf, key_min.float())
    high = torch.einsum("kgd,ckd->ckgd", qf, key_max.float())
    return torch.maximum(low, high).sum(-1).flatten(1).amax(-1)


"""Attention of draft queries over a committed context plus masked new entries (float32 softmax).

One function serves the three places the draft attends: extending its KV with committed
entries (new entries causal), expanding a tree (new entries = ancestors and self), and the
salience path (the context is the working set instead of the whole history).
"""

from __future__ import annotations

import torch


def draft_attention(
    q: torch.Tensor,  # [n, heads, hd]
    ctx_k: torch.Tensor,  # [ctx, kv_heads, hd] committed keys (whole context or working set)
    ctx_v: torch.Tensor,  # [ctx, kv_heads, hd]
    new_k: torch.Tensor,  # [m, kv_heads, hd] keys of entries not yet committed
    new_v: torch.Tensor,  # [m, kv_heads, hd]
    new_mask: torch.Tensor,  # [n, m] bool: query i sees new entry j
    scale: float,
) -> torch.Tensor:  # [n, heads, hd] in q's dtype
    group = q.shape[1] // new_k.shape[1]
    keys = torch.cat([ctx_k, new_k]).repeat_interleave(group, dim=1)  # [ctx + m, heads, hd]
    values = torch.cat([ctx_v, new_v]).repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, keys).float() * scale
    visible = torch.cat([torch.ones(q.shape[0], ctx_k.shape[0], dtype=torch.bool, device=q.device), new_mask], dim=1)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnk,khd->nhd", probs.to(values.dtype), values)

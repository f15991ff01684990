"""Attention of draft queries over a committed context plus masked new entries (float32 softmax).

One function serves the three places the draft attends: extending its KV with committed
entries, expanding a tree (new entries = ancestors and self), and the salience path (the
context is the working set instead of the whole history). The context and the new entries
are scored separately and joined by one softmax over both, so the context (up to the whole
history for the EAGLE-3 baseline) is never copied; query heads are grouped per KV head
instead of repeating keys.
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
    ctx_valid: torch.Tensor | None = None,  # [ctx] bool: keys past a padded context's length are False
) -> torch.Tensor:  # [n, heads, hd] in q's dtype
    n, heads, hd = q.shape
    kv_heads = ctx_k.shape[1]
    grouped = q.view(n, kv_heads, heads // kv_heads, hd)  # [n, kv_heads, group, hd]
    ctx_scores = torch.einsum("nkgd,ckd->kgnc", grouped, ctx_k).float() * scale  # [kv_heads, group, n, ctx]
    new_scores = torch.einsum("nkgd,mkd->kgnm", grouped, new_k).float() * scale  # [kv_heads, group, n, m]
    new_scores = new_scores.masked_fill(~new_mask, float("-inf"))
    if ctx_valid is not None:
        ctx_scores = ctx_scores.masked_fill(~ctx_valid, float("-inf"))
    probs = torch.softmax(torch.cat([ctx_scores, new_scores], dim=-1), dim=-1).to(q.dtype)
    ctx_probs, new_probs = probs.split([ctx_k.shape[0], new_k.shape[0]], dim=-1)
    out = torch.einsum("kgnc,ckd->nkgd", ctx_probs, ctx_v) + torch.einsum("kgnm,mkd->nkgd", new_probs, new_v)
    return out.reshape(n, heads, hd)

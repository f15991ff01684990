"""Plain PyTorch draft attention: the CPU path and the oracle for the Triton kernel.

Draft queries attend to a committed context (padded per session: keys at or past the session's
length are hidden) plus a few new entries under a bool mask, with one float32 softmax over both.
The context and the new entries are scored separately and joined by that softmax, so the context
is never concatenated; query heads are grouped per KV head instead of repeating keys. Leading
dimensions ``...`` (e.g. the batch of sessions) are shared by every argument. A query that sees
no key at all gets NaN here (softmax over nothing); the Triton kernel writes 0 for it.
"""

from __future__ import annotations

import torch


def draft_attention_reference(
    q: torch.Tensor,  # [..., n, heads, hd]
    ctx_k: torch.Tensor,  # [..., ctx, kv_heads, hd] committed keys (whole context or working set)
    ctx_v: torch.Tensor,  # [..., ctx, kv_heads, hd]
    new_k: torch.Tensor,  # [..., m, kv_heads, hd] keys of entries not yet committed
    new_v: torch.Tensor,  # [..., m, kv_heads, hd]
    new_mask: torch.Tensor,  # [..., n, m] bool: query i sees new entry j
    scale: float,
    ctx_lengths: torch.Tensor | None = None,  # [...] int64: keys at index >= length are padding; None: all valid
) -> torch.Tensor:  # [..., n, heads, hd] in q's dtype
    *lead, n, heads, hd = q.shape
    kv_heads = ctx_k.shape[-2]
    grouped = q.view(*lead, n, kv_heads, heads // kv_heads, hd)  # [..., n, kv_heads, group, hd]
    ctx_scores = torch.einsum("...nkgd,...ckd->...kgnc", grouped, ctx_k).float() * scale  # [..., kv, group, n, ctx]
    new_scores = torch.einsum("...nkgd,...mkd->...kgnm", grouped, new_k).float() * scale  # [..., kv, group, n, m]
    new_scores = new_scores.masked_fill(~new_mask[..., None, None, :, :], float("-inf"))
    if ctx_lengths is not None:
        ctx_valid = torch.arange(ctx_k.shape[-3], device=q.device) < ctx_lengths[..., None]  # [..., ctx]
        ctx_scores = ctx_scores.masked_fill(~ctx_valid[..., None, None, None, :], float("-inf"))
    probs = torch.softmax(torch.cat([ctx_scores, new_scores], dim=-1), dim=-1).to(q.dtype)
    ctx_probs, new_probs = probs.split([ctx_k.shape[-3], new_k.shape[-3]], dim=-1)
    out = torch.einsum("...kgnc,...ckd->...nkgd", ctx_probs, ctx_v) + torch.einsum(
        "...kgnm,...mkd->...nkgd", new_probs, new_v
    )
    return out.reshape(*lead, n, heads, hd)

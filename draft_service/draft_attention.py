"""Attention of draft queries over a committed context plus masked new entries (float32 softmax).

One function serves the three places the draft attends: extending its KV with committed
entries, expanding a batch of trees (new entries = ancestors and self, one context per
session, padded to a capacity: ``ctx_lengths`` says where each session's keys end), and the
salience path (the context is the working set instead of the whole history). On a GPU it is
one split-KV Triton kernel that reads only the keys below each length
(``kernels.draft_attention_triton``); elsewhere the PyTorch reference
(``kernels.draft_attention_ref``). Leading dimensions ``...`` (e.g. the batch of sessions) are
shared by every argument.
"""

from __future__ import annotations

import torch

from kernels.dispatch import triton_kernels_on
from kernels.draft_attention_ref import draft_attention_reference


def draft_attention(
    q: torch.Tensor,  # [..., n, heads, hd]
    ctx_k: torch.Tensor,  # [..., ctx, kv_heads, hd] committed keys (whole context or working set)
    ctx_v: torch.Tensor,  # [..., ctx, kv_heads, hd]
    new_k: torch.Tensor,  # [..., m, kv_heads, hd] keys of entries not yet committed
    new_v: torch.Tensor,  # [..., m, kv_heads, hd]
    new_mask: torch.Tensor,  # [..., n, m] bool: query i sees new entry j
    scale: float,
    ctx_lengths: torch.Tensor | None = None,  # [...] int64: keys at index >= length are padding; None: all valid
) -> torch.Tensor:  # [..., n, heads, hd] in q's dtype
    if not triton_kernels_on(q.device):
        return draft_attention_reference(q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, ctx_lengths)
    from kernels.draft_attention_triton import draft_attention_triton

    return draft_attention_triton(q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, ctx_lengths)

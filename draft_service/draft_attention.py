"""Attention of draft queries over a committed context plus masked new entries (float32 softmax).

``draft_attention`` serves the places the draft attends in a proposal: the roots' last committed
entries, expanding a batch of trees (new entries = ancestors and self, one context per session,
padded to a capacity: ``ctx_lengths`` says where each session's keys end), and the salience path
(the context is the working set instead of the whole history). On a GPU it is one split-KV
Triton kernel that reads only the keys below each length (``diffspec_kernels.draft_attention_triton``);
elsewhere the PyTorch reference (``diffspec_kernels.draft_attention_ref``). Leading dimensions ``...``
(e.g. the batch of sessions) are shared by every argument.

``causal_attention`` is the plain causal case: the newest rows of a sequence over it, as a layer
below the last of a deeper head attends when its entries are committed (their outputs feed the
layer above) and as ``Eagle3Head.forward_dense`` attends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffspec_kernels.dispatch import triton_kernels_on
from diffspec_kernels.draft_attention_ref import draft_attention_reference


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
    from diffspec_kernels.draft_attention_triton import draft_attention_triton

    return draft_attention_triton(q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, ctx_lengths)


def causal_attention(
    q: torch.Tensor,  # [..., n, heads, hd] queries of the last n positions of the keys
    keys: torch.Tensor,  # [..., length, kv_heads, hd]
    values: torch.Tensor,  # [..., length, kv_heads, hd]
    scale: float,
) -> torch.Tensor:  # [..., n, heads, hd]: query i sees keys 0 .. length - n + i
    n, length = q.shape[-3], keys.shape[-3]
    visible = torch.arange(length, device=q.device) <= torch.arange(length - n, length, device=q.device)[:, None]
    q, keys, values = (t.transpose(-3, -2) for t in (q, keys, values))  # heads before positions
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(-3, -2)

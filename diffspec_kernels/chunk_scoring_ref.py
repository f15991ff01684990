"""Chunk scoring for salience selection, a batch of sessions at once (PyTorch reference; the CPU path and
the Triton oracle).

Each chunk of draft keys is summarised per KV head by its element-wise min and max key. For a
query q, sum_i max(q_i * kmax_i, q_i * kmin_i) bounds q . k from above for every key k in the
chunk (Quest's bound), so a chunk that could hold a high-attention key never scores low. A
chunk's score is the largest bound over all query heads.

Every session's encodings live in one pool of pages (``draft_service/chunk_encoding.py``): session b's
chunk c is row c % page_chunks of page ``page_table[b, c // page_chunks]``. Scores come back padded to the
widest page table, -inf past each session's chunks, so the host selects on one [batch, chunks] array.
"""

from __future__ import annotations

import torch


def check_chunk_score_inputs(
    q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, page_table: torch.Tensor, num_chunks: torch.Tensor
) -> None:
    if q.ndim != 3 or key_min.ndim != 4 or key_min.shape != key_max.shape or key_min.shape[3] != q.shape[2]:
        raise ValueError(f"shapes q {tuple(q.shape)}, key_min {tuple(key_min.shape)}, key_max {tuple(key_max.shape)}")
    if q.shape[1] % key_min.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {key_min.shape[2]} kv heads")
    if page_table.ndim != 2 or page_table.shape[0] != q.shape[0] or num_chunks.shape != (q.shape[0],):
        shapes = f"page_table {tuple(page_table.shape)}, num_chunks {tuple(num_chunks.shape)}"
        raise ValueError(f"{shapes} for a batch of {q.shape[0]}")
    if page_table.dtype != torch.int64 or num_chunks.dtype != torch.int64:
        raise ValueError("page_table and num_chunks must be int64")
    if key_max.dtype != key_min.dtype:
        raise ValueError(f"key_min is {key_min.dtype}, key_max {key_max.dtype}")


def chunk_scores_reference(
    q: torch.Tensor,  # [batch, num_heads, head_dim] each session's newest query
    key_min: torch.Tensor,  # [num_pages, page_chunks, num_kv_heads, head_dim] pooled min keys
    key_max: torch.Tensor,  # [num_pages, page_chunks, num_kv_heads, head_dim] pooled max keys
    page_table: torch.Tensor,  # [batch, max_pages] int64: session b's pages in order (any page past its chunks)
    num_chunks: torch.Tensor,  # [batch] int64: chunks session b holds, at most max_pages * page_chunks
) -> torch.Tensor:  # [batch, max_pages * page_chunks] float32, -inf at and past num_chunks[b]
    check_chunk_score_inputs(q, key_min, key_max, page_table, num_chunks)
    batch, num_heads, head_dim = q.shape
    kv_heads = key_min.shape[2]
    qf = q.float().view(batch, kv_heads, num_heads // kv_heads, head_dim).transpose(2, 3)  # [batch, kv, hd, group]
    kmin = key_min[page_table].flatten(1, 2).transpose(1, 2).float()  # [batch, kv_heads, chunks, hd]
    kmax = key_max[page_table].flatten(1, 2).transpose(1, 2).float()
    # max(q_i * kmax_i, q_i * kmin_i) takes kmax_i where q_i > 0, kmin_i where q_i < 0 (kmin <= kmax): two
    # matrix products rather than the [batch, chunks, heads, hd] products themselves, in float32 even under a
    # caller's autocast (the trainer's bf16), as the ranking of the scores requires
    with torch.autocast(q.device.type, enabled=False):
        bounds = kmax @ qf.clamp(min=0) + kmin @ qf.clamp(max=0)  # [batch, kv_heads, chunks, group]
    scores = bounds.amax(dim=(1, 3))  # [batch, chunks]
    past = torch.arange(scores.shape[1], device=q.device) >= num_chunks[:, None]
    return scores.masked_fill(past, float("-inf"))

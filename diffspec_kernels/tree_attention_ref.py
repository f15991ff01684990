"""Plain PyTorch tree attention over paged KV: the CPU path and the oracle for the Triton kernel.

For each sequence, the new tokens' queries attend to the committed context (gathered from its
pages through the block table, no mask) and to the new tokens themselves under the sequence's
new-token mask. Softmax runs in float32; GQA repeats each KV head for its group of query heads.
"""

from __future__ import annotations

import torch

from diffspec_kernels.attention_metadata import AttentionMetadata


def gather_context(pages: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim] committed keys or values of one sequence, in position order."""
    page_size = pages.shape[1]
    num_pages = (context_len + page_size - 1) // page_size
    gathered = pages[block_table[:num_pages].long()]  # [num_pages, page_size, H_kv, D]
    return gathered.reshape(-1, *pages.shape[2:])[:context_len]


def tree_attention_reference(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    num_heads, num_kv_heads = q.shape[1], k_new.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    context_lens = meta.context_lens_t.tolist()  # one host read: the reference loops per sequence
    for b, (q_len, ctx_len) in enumerate(zip(meta.q_lens, context_lens)):
        rows = slice(start, start + q_len)
        keys = torch.cat([gather_context(k_pages, meta.block_tables[b], ctx_len), k_new[rows]])
        values = torch.cat([gather_context(v_pages, meta.block_tables[b], ctx_len), v_new[rows]])
        keys = keys.float().repeat_interleave(group, dim=1)  # [ctx + q_len, H, D]
        values = values.float().repeat_interleave(group, dim=1)
        # in place: at a 64K context one 2,048-token prefill chunk's scores are 17 GB in fp32
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys).mul_(scale)  # [H, q_len, ctx + q_len]
        visible = torch.ones(q_len, ctx_len + q_len, dtype=torch.bool, device=q.device)
        visible[:, ctx_len:] = meta.new_token_mask[rows, :q_len]
        scores.masked_fill_(~visible, float("-inf"))
        probs = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()  # softmax in place: each row sees itself
        probs.div_(probs.sum(dim=-1, keepdim=True))
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
        start += q_len
    return out

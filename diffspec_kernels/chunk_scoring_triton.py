"""Triton chunk scoring for salience selection, a batch of sessions in one launch; same function as
``chunk_scores_reference``.

One program scores one page of one session's chunks for all query heads: it loads the page's id from
the session's page table, then per KV head the page's min and max keys ([BLOCK_C, D] each) once and,
for each query head of the group, reduces max(q * kmin, q * kmax) over D, keeping the running max over
heads. The grid is sessions x the widest page table; a page past a session's chunks writes -inf. At
128K context and 64-token chunks a session holds 2,048 chunks, 32 pages of 64: 16 sessions are 512
programs, one launch. The scores then go to the host in one copy queued behind the accept, where the
working sets are chosen (``draft_service/draft_context.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.chunk_scoring_ref import check_chunk_score_inputs


@triton.jit(
    do_not_specialize=["max_pages"],  # one compile as the contexts grow past multiples of 16 pages
    do_not_specialize_on_alignment=["page_table_ptr", "num_chunks_ptr"],  # pieces of one upload, at any offset
)
def _chunk_scores_kernel(
    q_ptr,  # [batch, NUM_KV_HEADS * GROUP, HEAD_DIM]
    kmin_ptr,  # [num_pages, PAGE_CHUNKS, NUM_KV_HEADS, HEAD_DIM]
    kmax_ptr,  # [num_pages, PAGE_CHUNKS, NUM_KV_HEADS, HEAD_DIM]
    page_table_ptr,  # [batch, max_pages] int64
    num_chunks_ptr,  # [batch] int64
    out_ptr,  # [batch, max_pages * PAGE_CHUNKS] float32
    max_pages,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,  # next power of two >= PAGE_CHUNKS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
):
    session = tl.program_id(0).to(tl.int64)
    page_index = tl.program_id(1)
    offsets = tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    chunks = page_index * PAGE_CHUNKS + offsets  # the session's chunk ids
    held = (offsets < PAGE_CHUNKS) & (chunks < tl.load(num_chunks_ptr + session))
    page = tl.load(page_table_ptr + session * max_pages + page_index)
    valid = held[:, None] & (dims[None, :] < HEAD_DIM)
    q_row = q_ptr + session * NUM_KV_HEADS * GROUP * HEAD_DIM
    best = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for kv in range(NUM_KV_HEADS):
        offsets_kd = ((page * PAGE_CHUNKS + offsets[:, None]) * NUM_KV_HEADS + kv) * HEAD_DIM + dims[None, :]
        kmin = tl.load(kmin_ptr + offsets_kd, mask=valid, other=0.0).to(tl.float32)
        kmax = tl.load(kmax_ptr + offsets_kd, mask=valid, other=0.0).to(tl.float32)
        for g in range(GROUP):
            q = tl.load(q_row + (kv * GROUP + g) * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
            bound = tl.sum(tl.maximum(q[None, :] * kmin, q[None, :] * kmax), axis=1)
            best = tl.maximum(best, bound)
    best = tl.where(held, best, float("-inf"))
    tl.store(out_ptr + session * max_pages * PAGE_CHUNKS + chunks, best, mask=offsets < PAGE_CHUNKS)


def chunk_scores_triton(
    q: torch.Tensor,  # [batch, num_heads, head_dim] each session's newest query
    key_min: torch.Tensor,  # [num_pages, page_chunks, num_kv_heads, head_dim] pooled min keys
    key_max: torch.Tensor,  # [num_pages, page_chunks, num_kv_heads, head_dim] pooled max keys
    page_table: torch.Tensor,  # [batch, max_pages] int64: session b's pages in order (any page past its chunks)
    num_chunks: torch.Tensor,  # [batch] int64: chunks session b holds, at most max_pages * page_chunks
) -> torch.Tensor:  # [batch, max_pages * page_chunks] float32, -inf at and past num_chunks[b]
    check_chunk_score_inputs(q, key_min, key_max, page_table, num_chunks)
    q, key_min, key_max = q.contiguous(), key_min.contiguous(), key_max.contiguous()
    page_table, num_chunks = page_table.contiguous(), num_chunks.contiguous()
    batch, max_pages = page_table.shape
    _, page_chunks, kv_heads, head_dim = key_min.shape
    out = torch.empty(batch, max_pages * page_chunks, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    _chunk_scores_kernel[(batch, max_pages)](
        q, key_min, key_max, page_table, num_chunks, out, max_pages,
        NUM_KV_HEADS=kv_heads, GROUP=q.shape[1] // kv_heads, HEAD_DIM=head_dim, PAGE_CHUNKS=page_chunks,
        BLOCK_C=triton.next_power_of_2(page_chunks), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out

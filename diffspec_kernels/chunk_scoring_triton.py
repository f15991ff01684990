"""Triton chunk scoring for salience selection; same function as ``chunk_scores_reference``.

One program scores BLOCK_C chunks for all query heads: per KV head it loads the chunk block's
min and max keys once ([BLOCK_C, D] each) and, for each query head of the group, reduces
max(q * kmin, q * kmax) over D, keeping the running max over heads. At 128K context and
64-token chunks that is 2,048 chunks: a handful of programs, one launch. The scores then go to
the host in one copy queued behind the accept, where the working set is chosen
(``draft_service/draft_context.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_chunks"])  # one compile as the context grows past multiples of 16 chunks
def _chunk_scores_kernel(
    q_ptr,  # [num_heads, head_dim]
    kmin_ptr,  # [num_chunks, num_kv_heads, head_dim]
    kmax_ptr,  # [num_chunks, num_kv_heads, head_dim]
    out_ptr,  # [num_chunks] float32
    num_chunks,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    chunks = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    dims = tl.arange(0, BLOCK_D)
    valid = (chunks[:, None] < num_chunks) & (dims[None, :] < HEAD_DIM)
    best = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for kv in range(NUM_KV_HEADS):
        offsets = (chunks[:, None].to(tl.int64) * NUM_KV_HEADS + kv) * HEAD_DIM + dims[None, :]
        kmin = tl.load(kmin_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        kmax = tl.load(kmax_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        for g in range(GROUP):
            q = tl.load(q_ptr + (kv * GROUP + g) * HEAD_DIM + dims, mask=dims < HEAD_DIM, other=0.0).to(tl.float32)
            bound = tl.sum(tl.maximum(q[None, :] * kmin, q[None, :] * kmax), axis=1)
            best = tl.maximum(best, bound)
    tl.store(out_ptr + chunks, best, mask=chunks < num_chunks)


def chunk_scores_triton(
    q: torch.Tensor,  # [num_heads, head_dim]
    key_min: torch.Tensor,  # [num_chunks, num_kv_heads, head_dim]
    key_max: torch.Tensor,  # [num_chunks, num_kv_heads, head_dim]
) -> torch.Tensor:  # [num_chunks] float32
    if q.ndim != 2 or key_min.ndim != 3 or key_min.shape != key_max.shape or key_min.shape[2] != q.shape[1]:
        raise ValueError(f"shapes q {tuple(q.shape)}, key_min {tuple(key_min.shape)}, key_max {tuple(key_max.shape)}")
    if q.shape[0] % key_min.shape[1]:
        raise ValueError(f"{q.shape[0]} query heads do not group over {key_min.shape[1]} kv heads")
    q, key_min, key_max = q.contiguous(), key_min.contiguous(), key_max.contiguous()
    num_chunks = key_min.shape[0]
    out = torch.empty(num_chunks, dtype=torch.float32, device=q.device)
    if num_chunks == 0:
        return out
    block_c = 64
    _chunk_scores_kernel[(triton.cdiv(num_chunks, block_c),)](
        q, key_min, key_max, out, num_chunks,
        NUM_KV_HEADS=key_min.shape[1], GROUP=q.shape[0] // key_min.shape[1], HEAD_DIM=q.shape[1],
        BLOCK_C=block_c, BLOCK_D=triton.next_power_of_2(q.shape[1]),
    )
    return out

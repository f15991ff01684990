"""Commit accepted tokens' keys/values into their KV slots, for every layer in one launch.

Same function as ``diffspec_kernels.kv_commit_ref.kv_commit_reference``. Doing it once for all layers after
the forward, from device index tensors, costs one launch and no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.kv_commit_ref import check_kv_commit_inputs


@triton.jit(do_not_specialize=["num_new_tokens"])  # one compile whatever a step commits
def _kv_commit_kernel(
    k_pages_ptr,  # [layers, num_slots, TOKEN_SIZE]
    v_pages_ptr,  # [layers, num_slots, TOKEN_SIZE]
    new_k_ptr,  # [layers, num_new_tokens, TOKEN_SIZE]
    new_v_ptr,  # [layers, num_new_tokens, TOKEN_SIZE]
    rows_ptr,  # [n] int64
    slots_ptr,  # [n] int64
    num_slots,
    num_new_tokens,
    TOKEN_SIZE: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two >= TOKEN_SIZE
):
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + i)
    slot = tl.load(slots_ptr + i)
    offsets = tl.arange(0, BLOCK)
    in_token = offsets < TOKEN_SIZE
    src = (layer * num_new_tokens + row) * TOKEN_SIZE + offsets
    dst = (layer * num_slots + slot) * TOKEN_SIZE + offsets
    tl.store(k_pages_ptr + dst, tl.load(new_k_ptr + src, mask=in_token), mask=in_token)
    tl.store(v_pages_ptr + dst, tl.load(new_v_ptr + src, mask=in_token), mask=in_token)


def kv_commit_triton(
    k_pages_all: torch.Tensor,  # [layers, num_pages, page_size, num_kv_heads, head_dim], written in place
    v_pages_all: torch.Tensor,  # [layers, num_pages, page_size, num_kv_heads, head_dim], written in place
    new_k: torch.Tensor,  # [layers, num_new_tokens, num_kv_heads, head_dim]
    new_v: torch.Tensor,  # [layers, num_new_tokens, num_kv_heads, head_dim]
    rows: torch.Tensor,  # [n] int64: which new token
    slots: torch.Tensor,  # [n] int64: into which flat slot (page * page_size + offset)
) -> None:
    check_kv_commit_inputs(k_pages_all, v_pages_all, new_k, new_v, rows, slots)
    num_layers, num_pages, page_size, num_kv_heads, head_dim = k_pages_all.shape
    if rows.numel() == 0:
        return
    token_size = num_kv_heads * head_dim
    _kv_commit_kernel[(rows.numel(), num_layers)](
        k_pages_all, v_pages_all, new_k, new_v, rows, slots,
        num_pages * page_size, new_k.shape[1],
        TOKEN_SIZE=token_size, BLOCK=triton.next_power_of_2(token_size), num_warps=4,
    )  # fmt: skip

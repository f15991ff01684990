"""Plain PyTorch KV commit: the CPU path and the oracle for ``diffspec_kernels.kv_commit_triton``.

After verification, the accepted new tokens (rows of the verify batch) are written into the slots the
block manager gave them (slot = page * page_size + offset), in every layer.
"""

from __future__ import annotations

import torch


def check_kv_commit_inputs(k_pages_all, v_pages_all, new_k, new_v, rows, slots) -> None:
    if k_pages_all.shape != v_pages_all.shape or k_pages_all.dim() != 5:
        raise ValueError(f"k/v pages must be equal [layers, pages, page_size, kv_heads, head_dim], got {k_pages_all.shape}")
    num_layers, _, _, num_kv_heads, head_dim = k_pages_all.shape
    if new_k.shape != new_v.shape or new_k.dim() != 4 or (new_k.shape[0], *new_k.shape[2:]) != (
        num_layers,
        num_kv_heads,
        head_dim,
    ):
        raise ValueError(f"new_k/new_v must be [{num_layers}, tokens, {num_kv_heads}, {head_dim}], got {new_k.shape}")
    if rows.shape != slots.shape or rows.dim() != 1 or rows.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError("rows and slots must be [n] int64")
    tensors = {"k_pages_all": k_pages_all, "v_pages_all": v_pages_all, "new_k": new_k, "new_v": new_v}
    for name, tensor in tensors.items():
        if tensor.dtype != k_pages_all.dtype or not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous {k_pages_all.dtype}")


def kv_commit_reference(
    k_pages_all: torch.Tensor,  # [layers, num_pages, page_size, num_kv_heads, head_dim], written in place
    v_pages_all: torch.Tensor,  # [layers, num_pages, page_size, num_kv_heads, head_dim], written in place
    new_k: torch.Tensor,  # [layers, num_new_tokens, num_kv_heads, head_dim]
    new_v: torch.Tensor,  # [layers, num_new_tokens, num_kv_heads, head_dim]
    rows: torch.Tensor,  # [n] int64: which new token
    slots: torch.Tensor,  # [n] int64: into which flat slot (page * page_size + offset), distinct
) -> None:
    check_kv_commit_inputs(k_pages_all, v_pages_all, new_k, new_v, rows, slots)
    num_layers, _, _, num_kv_heads, head_dim = k_pages_all.shape
    k_pages_all.view(num_layers, -1, num_kv_heads, head_dim)[:, slots] = new_k[:, rows]
    v_pages_all.view(num_layers, -1, num_kv_heads, head_dim)[:, slots] = new_v[:, rows]

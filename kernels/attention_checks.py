"""Input checks every tree-attention kernel shares; each kernel adds its own dtype and size rules."""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata


def check_attention_inputs(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    meta: AttentionMetadata,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Shapes, dtypes, devices and contiguity a kernel relies on, so a bad call fails here and not in the kernel."""
    tensors = {"q": q, "k_new": k_new, "v_new": v_new, "k_pages": k_pages, "v_pages": v_pages}
    for name, tensor in tensors.items():
        if tensor.dtype != q.dtype or q.dtype not in dtypes:
            raise TypeError(f"{name} is {tensor.dtype}; all inputs must share one of {dtypes}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    if k_new.shape != (total_q, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new must be [{total_q}, kv_heads, {head_dim}], got {k_new.shape}, {v_new.shape}")
    if k_pages.shape != v_pages.shape or k_pages.shape[1:] != (meta.page_size, num_kv_heads, head_dim):
        raise ValueError(f"k_pages/v_pages must be [pages, {meta.page_size}, {num_kv_heads}, {head_dim}]")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if sum(meta.q_lens) != total_q or tuple(meta.new_token_mask.shape) != (total_q, meta.max_q_len):
        raise ValueError("meta.q_lens / new_token_mask do not match q")
    for name in ("cu_q_lens", "context_lens_t", "block_tables"):
        tensor = getattr(meta, name)
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise TypeError(f"meta.{name} must be contiguous int32")

"""Input checks the attention kernels share, so a bad call fails in the wrapper and not in a kernel, every
wrapper with the same kind of error: a wrong dtype raises TypeError, a wrong shape, layout or device ValueError.

``check_attention_inputs`` checks a tree-attention call (new tokens over paged KV), ``check_draft_attention_inputs``
a draft-attention call (queries over a dense per-session context plus masked new entries); each kernel adds its
own dtype and size rules (``check_triton_head_dim`` for the Triton ones).
"""

from __future__ import annotations

import torch

from diffspec_kernels.attention_metadata import AttentionMetadata


def _shape(*dims: object) -> str:
    """A shape for a message: ``_shape(2, "m", 16)`` is "[2, m, 16]"."""
    return f"[{', '.join(map(str, dims))}]"


def _check_tensor(name: str, tensor: torch.Tensor, dtype: torch.dtype, device: torch.device, contiguous: bool) -> None:
    """One tensor's dtype, device and (when the kernel indexes it flat) contiguity."""
    if tensor.dtype != dtype:
        raise TypeError(f"{name} is {tensor.dtype}, expected {dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, q on {device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_qkv(tensors: dict[str, torch.Tensor], dtypes: tuple[torch.dtype, ...]) -> None:
    """Queries, keys and values (``tensors`` by name, q first): one of ``dtypes`` for all, q's device, contiguous."""
    q = tensors["q"]
    if q.dtype not in dtypes:
        raise TypeError(f"q is {q.dtype}; q, keys and values must share one of {dtypes}")
    for name, tensor in tensors.items():
        _check_tensor(name, tensor, q.dtype, q.device, contiguous=True)


def _check_head_counts(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")


def check_triton_head_dim(head_dim: int) -> None:
    """A Triton kernel's head_dim is a tl.arange length and a tl.dot size."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")


def check_attention_inputs(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    dtypes: tuple[torch.dtype, ...],
) -> None:
    _check_qkv({"q": q, "k_new": k_new, "v_new": v_new, "k_pages": k_pages, "v_pages": v_pages}, dtypes)
    if q.dim() != 3 or k_new.dim() != 3:
        raise ValueError(f"q and k_new must be [total_q, heads, head_dim], got {tuple(q.shape)}, {tuple(k_new.shape)}")
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_new.shape[1]
    if k_new.shape != (total_q, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"k_new/v_new must be {_shape(total_q, 'kv_heads', head_dim)}, "
            f"got {tuple(k_new.shape)}, {tuple(v_new.shape)}"
        )
    if k_pages.shape != v_pages.shape or k_pages.shape[1:] != (meta.page_size, num_kv_heads, head_dim):
        raise ValueError(
            f"k_pages/v_pages must be {_shape('pages', meta.page_size, num_kv_heads, head_dim)}, "
            f"got {tuple(k_pages.shape)}, {tuple(v_pages.shape)}"
        )
    _check_head_counts(num_heads, num_kv_heads)
    for name in ("cu_q_lens", "context_lens_t", "block_tables"):
        _check_tensor(f"meta.{name}", getattr(meta, name), torch.int32, q.device, contiguous=True)
    _check_tensor("meta.new_token_mask", meta.new_token_mask, torch.bool, q.device, contiguous=True)
    if sum(meta.q_lens) != total_q or tuple(meta.new_token_mask.shape) != (total_q, meta.max_q_len):
        raise ValueError("meta.q_lens / new_token_mask do not match q")


def check_draft_attention_inputs(
    q: torch.Tensor,  # [..., n, heads, hd]
    ctx_k: torch.Tensor,  # [..., ctx, kv_heads, hd]
    ctx_v: torch.Tensor,  # [..., ctx, kv_heads, hd]
    new_k: torch.Tensor,  # [..., m, kv_heads, hd]
    new_v: torch.Tensor,  # [..., m, kv_heads, hd]
    new_mask: torch.Tensor,  # [..., n, m] bool, last dim contiguous
    ctx_lengths: torch.Tensor | None,  # [...] int64, any stride
    dtypes: tuple[torch.dtype, ...],
) -> None:
    _check_qkv({"q": q, "ctx_k": ctx_k, "ctx_v": ctx_v, "new_k": new_k, "new_v": new_v}, dtypes)
    if q.dim() < 3 or ctx_k.dim() != q.dim() or new_k.dim() != q.dim():
        raise ValueError(
            f"q must be [..., n, heads, hd] and ctx_k, new_k [..., keys, kv_heads, hd], "
            f"got {tuple(q.shape)}, {tuple(ctx_k.shape)}, {tuple(new_k.shape)}"
        )
    *lead, num_queries, num_heads, head_dim = q.shape
    lead = tuple(lead)
    capacity, num_kv_heads = ctx_k.shape[-3], ctx_k.shape[-2]
    num_new = new_k.shape[-3]
    if ctx_k.shape != (*lead, capacity, num_kv_heads, head_dim) or ctx_v.shape != ctx_k.shape:
        raise ValueError(
            f"ctx_k/ctx_v must be {_shape(*lead, 'ctx', 'kv_heads', head_dim)}, "
            f"got {tuple(ctx_k.shape)}, {tuple(ctx_v.shape)}"
        )
    if new_k.shape != (*lead, num_new, num_kv_heads, head_dim) or new_v.shape != new_k.shape:
        raise ValueError(
            f"new_k/new_v must be {_shape(*lead, 'm', num_kv_heads, head_dim)}, "
            f"got {tuple(new_k.shape)}, {tuple(new_v.shape)}"
        )
    _check_head_counts(num_heads, num_kv_heads)
    if num_queries < 1:
        raise ValueError(f"q must hold at least one query, got {tuple(q.shape)}")
    _check_tensor("new_mask", new_mask, torch.bool, q.device, contiguous=False)
    if new_mask.shape != (*lead, num_queries, num_new):
        raise ValueError(f"new_mask must be {_shape(*lead, num_queries, num_new)}, got {tuple(new_mask.shape)}")
    if num_new > 1 and new_mask.stride(-1) != 1:
        raise ValueError("new_mask's last dim must be contiguous")
    if ctx_lengths is not None:
        _check_tensor("ctx_lengths", ctx_lengths, torch.int64, q.device, contiguous=False)
        if ctx_lengths.shape != lead:
            raise ValueError(f"ctx_lengths must be {_shape(*lead)}, got {tuple(ctx_lengths.shape)}")

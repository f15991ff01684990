"""Tree attention with FlashAttention 2 over the committed prefix, PyTorch over the new tokens, an LSE merge.

Same function as ``diffspec_kernels.tree_attention_ref.tree_attention_reference``. FlashAttention takes no custom
mask, so a tree is split by key set into two softmax partials that merge exactly:

1. Committed prefix: one ``flash_attn_with_kvcache`` call reads each sequence's pages through its block
   table (our page arrays are already flash-attn's paged layout, GQA native), no mask, and returns the
   output with its log-sum-exp. The call never appends KV: rejected tree nodes must not touch the pages.
2. The sequence's own new tokens under ``new_token_mask``: a few tokens per sequence, so plain fp32
   PyTorch over the batch padded to [batch, max_q_len], with no loop over sequences.
3. An fp32 merge weighted by each part's LSE, then the padded rows are dropped.

Every shape depends only on q, the page arrays and ``meta.q_lens`` (fixed per padded bucket), and the
context lengths are only read on the device, so a CUDA graph can capture and replay a call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffspec_kernels.attention_checks import check_attention_inputs
from diffspec_kernels.attention_metadata import AttentionMetadata

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # FlashAttention 2 has no fp32 kernels
_PAGE_MULTIPLE = 256  # flash-attn 2 refuses paged KV in pages of any other size
_MAX_HEAD_DIM = 256


def _flash_kvcache() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``flash_attn.flash_attn_with_kvcache``, imported on use: flash-attn is optional and absent on CPU."""
    from flash_attn import flash_attn_with_kvcache

    return flash_attn_with_kvcache


def _check_inputs(q, k_new, v_new, k_pages, v_pages, meta: AttentionMetadata) -> None:
    check_attention_inputs(q, k_new, v_new, k_pages, v_pages, meta, _SUPPORTED_DTYPES)
    head_dim = q.shape[2]
    if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"flash-attn needs head_dim a multiple of 8 and at most {_MAX_HEAD_DIM}, got {head_dim}")
    if meta.page_size % _PAGE_MULTIPLE:
        raise ValueError(
            f"flash-attn 2 reads paged KV only in pages of a multiple of {_PAGE_MULTIPLE} tokens, got page_size "
            f"{meta.page_size}: set page_size to a multiple of {_PAGE_MULTIPLE} or use the triton backend"
        )


def _padded_rows(meta: AttentionMetadata, total_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row of each padded slot [batch, max_q_len] (clamped; pad slots repeat a real row) and its validity."""
    slots = torch.arange(meta.max_q_len, dtype=torch.int32, device=meta.cu_q_lens.device)
    rows = meta.cu_q_lens[:-1, None] + slots  # [batch, max_q_len]
    valid = rows < meta.cu_q_lens[1:, None]
    return rows.clamp(max=total_q - 1).long(), valid


def _packed_slots(meta: AttentionMetadata, total_q: int) -> torch.Tensor:
    """[total_q] int64: where each packed row sits in the flattened [batch * max_q_len] padding."""
    rows = torch.arange(total_q, dtype=torch.int32, device=meta.cu_q_lens.device)
    seq = torch.searchsorted(meta.cu_q_lens[1:], rows, right=True)  # no host sync, unlike repeat_interleave
    return seq * meta.max_q_len + (rows - meta.cu_q_lens[seq])


def _attend_new_tokens(
    q: torch.Tensor,  # [batch, T, num_heads, head_dim]
    k: torch.Tensor,  # [batch, T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [batch, T, num_kv_heads, head_dim]
    visible: torch.Tensor,  # [batch, T, T] bool: query slot i sees key slot j
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [batch, T, num_heads, head_dim] fp32, lse [batch, num_heads, T] fp32
    """Masked softmax attention in fp32; a row that sees nothing gets out 0 and lse -inf (weight 0 in the merge)."""
    batch, slots, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    grouped_q = q.float().view(batch, slots, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bqkgd,bskd->bkgqs", grouped_q, k.float()) * scale  # query head = kv head * group + g
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    lse = scores.logsumexp(dim=-1)  # [batch, kv_heads, group, T]
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # all -inf row: exp(-inf) = 0, not NaN
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v.float())
    return out.reshape(batch, slots, num_heads, head_dim), lse.reshape(batch, num_heads, slots)


def _merge(
    out_a: torch.Tensor,  # [batch, T, num_heads, head_dim]
    lse_a: torch.Tensor,  # [batch, num_heads, T] fp32, natural log
    out_b: torch.Tensor,  # [batch, T, num_heads, head_dim]
    lse_b: torch.Tensor,  # [batch, num_heads, T] fp32, natural log
) -> torch.Tensor:  # [batch, T, num_heads, head_dim] fp32
    """Softmax over the union of two disjoint key sets from each set's normalised output and LSE."""
    lse = torch.logaddexp(lse_a, lse_b).nan_to_num(neginf=0.0)  # both empty: weights exp(-inf) = 0
    weight_a = torch.exp(lse_a - lse).transpose(1, 2)[..., None]  # [batch, T, num_heads, 1]
    weight_b = torch.exp(lse_b - lse).transpose(1, 2)[..., None]
    return weight_a * out_a.float() + weight_b * out_b.float()


def tree_attention_flash(
    q: torch.Tensor,  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor,  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [total_q, num_heads, head_dim]
    _check_inputs(q, k_new, v_new, k_pages, v_pages, meta)
    total_q = q.shape[0]
    rows, valid = _padded_rows(meta, total_q)
    q_padded = q[rows]  # [batch, T, num_heads, head_dim]

    out_context, lse_context = _flash_kvcache()(
        q_padded, k_pages, v_pages, cache_seqlens=meta.context_lens_t, block_table=meta.block_tables,
        softmax_scale=scale, causal=False, return_softmax_lse=True,
    )  # fmt: skip
    # flash-attn 2 gives a row with no keys lse +inf, which would swamp the merge: no context, no weight.
    no_context = meta.context_lens_t == 0  # [batch]
    lse_context = lse_context.masked_fill(no_context[:, None, None], float("-inf"))
    out_context = out_context.masked_fill(no_context[:, None, None, None], 0.0)

    visible = meta.new_token_mask[rows] & valid[:, None, :]  # [batch, T, T]; keys past q_len are padding
    out_tree, lse_tree = _attend_new_tokens(q_padded, k_new[rows], v_new[rows], visible, scale)

    out = _merge(out_context, lse_context, out_tree, lse_tree).to(q.dtype)
    return out.flatten(0, 1)[_packed_slots(meta, total_q)]

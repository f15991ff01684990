"""Each row's best children in one launch: log-softmax, top-k and the map to target ids.

Same function as ``diffspec_kernels.top_children_ref`` (equal ids, log-probs to the last bit or two: the
sum of exponentials runs in another order). torch's top-k over a few rows of a 4K-32K vocabulary
is a radix select of several passes, about 30 us a call on an H200, which made it the largest
non-matmul cost of a proposal; here one program reads its row once, takes the log-sum-exp, then
picks the ``k`` largest one after another (ties to the lower draft id).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffspec_kernels.top_children_ref import top_children_reference

MAX_VOCAB = 32768  # a row is one block of registers; wider vocabularies take the reference
MAX_CHILDREN = 64  # beyond this the k sequential picks cost more than torch's select


@triton.jit(do_not_specialize=["k"])
def _top_children_kernel(
    logits_ptr,  # [rows, vocab], row stride row_stride
    target_ids_ptr,  # [vocab] int64
    log_probs_ptr,  # [rows, k] float32 out
    ids_ptr,  # [rows, k] int64 out
    vocab, row_stride, k,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * row_stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.max(x, 0)
    log_sum = tl.log(tl.sum(tl.exp(x - top), 0))  # log_softmax(x) = x - max - log(sum(exp(x - max)))
    for i in range(k):
        value, best = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)  # one reduction, not two
        tl.store(log_probs_ptr + row * k + i, (value - top) - log_sum)
        tl.store(ids_ptr + row * k + i, tl.load(target_ids_ptr + best))
        x = tl.where(cols == best, float("-inf"), x)


def top_children_triton(
    logits: torch.Tensor, k: int, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., vocab] (last dim contiguous), target_ids [vocab] int64 -> [..., k] float32 log-probs, int64 ids."""
    vocab = logits.shape[-1]
    if vocab > MAX_VOCAB or k > MAX_CHILDREN or logits.stride(-1) != 1:
        rows = logits.reshape(-1, vocab)
        out = top_children_reference(rows, k, target_ids)
        return tuple(t.view(*logits.shape[:-1], k) for t in out)  # type: ignore[return-value]
    if target_ids.shape != (vocab,) or target_ids.dtype != torch.int64:
        raise ValueError(f"target_ids must be int64 [{vocab}], got {target_ids.dtype} {tuple(target_ids.shape)}")
    rows = logits.reshape(-1, vocab)
    log_probs = torch.empty(rows.shape[0], k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.int64, device=logits.device)
    if rows.shape[0] and k:
        block = triton.next_power_of_2(vocab)
        _top_children_kernel[(rows.shape[0],)](
            rows, target_ids, log_probs, ids, vocab, rows.stride(0), k,
            BLOCK=block, num_warps=min(16, max(4, block // 1024)),
        )  # fmt: skip
    return log_probs.view(*logits.shape[:-1], k), ids.view(*logits.shape[:-1], k)

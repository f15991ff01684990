"""Weight-only int8 matmul: out = (x @ q.T) * scale, the weights read as int8.

Same function as ``diffspec_kernels.int8_linear_ref`` (fp32 sums in another order). A draft depth
multiplies a few dozen rows by every weight of the head, so what it costs is the weight bytes:
each program reads one ``BLOCK_N``-row strip of ``q`` once for all of x's rows (up to
``BLOCK_M``; more rows take more M tiles, and the M tiles of one strip run next to each other so
the strip's second read comes from L2), widens it to x's dtype in registers (exact: |q| <= 127)
and multiplies on the tensor cores. The per-row scale is applied once, to the fp32 sum.

Split K. A narrow output (4,096 channels in 32-channel strips: 128 programs) leaves SMs idle, and one
program per SM cannot keep enough bytes in flight to read at the memory's rate. The plan's ``split_k``
then gives each strip's K range to several programs, which write fp32 partial sums; a second launch adds
them in split order (the same sums on every run) and applies the scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from diffspec_kernels.split_plan import sm_count

MAX_SPLIT_K = 8  # partial sums a strip's K range is cut into at most
SUM_BLOCK = 1024  # outputs per program of the partial sums' addition


@dataclass(frozen=True)
class Int8LinearPlan:
    block_m: int  # rows of x per program
    block_n: int  # output channels (rows of q) per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs that share one strip's K range (1: no partial sums)


def int8_linear_plan(rows: int, out_features: int, in_features: int, num_sms: int) -> Int8LinearPlan:
    """Few rows (a draft depth: 1-64): narrow strips of N, so even a 4,096-wide output makes 128 programs, and
    long K steps, the K range split where the strips alone would not put two programs on each of ``num_sms``
    SMs (each split at least two K steps); many rows (a prompt's ingest): square-ish tiles that reuse each
    loaded strip more. ``num_sms`` 0 splits nothing."""
    if rows > 64:
        return Int8LinearPlan(64, 64, 64, num_warps=4, num_stages=3)
    tile = Int8LinearPlan(max(16, triton.next_power_of_2(rows)), 32, 256, num_warps=4, num_stages=4)
    programs = triton.cdiv(rows, tile.block_m) * triton.cdiv(out_features, tile.block_n)
    split = min(triton.cdiv(2 * num_sms, programs), in_features // (2 * tile.block_k), MAX_SPLIT_K)
    return replace(tile, split_k=max(1, split))


@triton.jit(do_not_specialize=["M"])  # the row count moves from call to call: one compile for all of them
def _int8_linear_kernel(
    x_ptr,  # [M, K] float (bf16 / fp16 / fp32), row stride x_stride, unit column stride
    q_ptr,  # [N, K] int8, contiguous
    scale_ptr,  # [N] float32
    out_ptr,  # [M, N] x's dtype, contiguous; with SPLIT [splits, M, N] float32, each split's unscaled sums
    M, N, K, x_stride, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    m_tile, n_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # M tiles vary fastest
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride  # [BLOCK_M, 1]
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    k_start = split * k_per_split  # k_per_split is a multiple of BLOCK_K
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < k_end
        x = tl.load(x_rows + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(q_rows + ks[None, :], mask=col_in[:, None] & k_in[None, :], other=0)  # [BLOCK_N, BLOCK_K] int8
        w = q.to(tl.float32).to(x.dtype)  # through fp32: exact, and what a GPU's conversion does anyway
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    outputs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    inside = row_in[:, None] & col_in[None, :]
    if SPLIT:
        tl.store(out_ptr + split.to(tl.int64) * M * N + outputs, acc, mask=inside)
    else:
        scale = tl.load(scale_ptr + cols, mask=col_in, other=0.0)
        tl.store(out_ptr + outputs, (acc * scale[None, :]).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sum_splits_kernel(
    partial_ptr,  # [SPLITS, total] float32: each split's unscaled sums
    scale_ptr,  # [N] float32
    out_ptr,  # [total] the output's dtype: [M, N] flattened
    total, N,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    outputs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = outputs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # in split order: the same sums on every run
        acc += tl.load(partial_ptr + split * total + outputs, mask=inside, other=0.0)
    scale = tl.load(scale_ptr + outputs % N, mask=inside, other=0.0)
    tl.store(out_ptr + outputs, (acc * scale).to(out_ptr.dtype.element_ty), mask=inside)


def int8_linear_triton(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, plan: Int8LinearPlan | None = None
) -> torch.Tensor:
    """x [..., K] (unit stride along K), q [N, K] int8 contiguous, scale [N] float32 -> [..., N] in x's dtype.
    ``plan``: the tiling (default ``int8_linear_plan`` of the row count, the shape and the device; the benchmark
    sweeps others)."""
    n, k = q.shape
    if q.dtype != torch.int8 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous int8 [out, in], got {q.dtype} of strides {q.stride()}")
    if scale.shape != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
    if x.shape[-1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be float [..., {k}], got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, k)  # a view for the flattened leading dims of a contiguous x, else one copy
    if rows.shape[0] and rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        plan = plan or int8_linear_plan(m, n, k, sm_count(x.device))
        k_per_split = triton.cdiv(triton.cdiv(k, plan.split_k), plan.block_k) * plan.block_k
        splits = triton.cdiv(k, k_per_split)
        sums = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
        grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), splits)
        _int8_linear_kernel[grid](
            rows, q, scale, sums, m, n, k, rows.stride(0), k_per_split,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, IEEE=x.dtype == torch.float32,
            SPLIT=splits > 1, num_warps=plan.num_warps, num_stages=plan.num_stages,
        )  # fmt: skip
        if splits > 1:
            _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
                sums, scale, out, m * n, n, SPLITS=splits, BLOCK=SUM_BLOCK
            )  # fmt: skip
    return out.view(*x.shape[:-1], n)

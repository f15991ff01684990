"""Weight-only int8 matmul in one launch: out = (x @ q.T) * scale, the weights read as int8.

Same function as ``diffspec_kernels.int8_linear_ref`` (fp32 sums in another order). A draft depth
multiplies a few dozen rows by every weight of the head, so what it costs is the weight bytes:
each program reads one ``BLOCK_N``-row strip of ``q`` once for all of x's rows (up to
``BLOCK_M``; more rows take more M tiles, and the M tiles of one strip run next to each other so
the strip's second read comes from L2), widens it to x's dtype in registers (exact: |q| <= 127)
and multiplies on the tensor cores. The per-row scale is applied once, to the fp32 sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Int8LinearPlan:
    block_m: int  # rows of x per program
    block_n: int  # output channels (rows of q) per program
    block_k: int  # reduction step
    num_warps: int
    num_stages: int


def int8_linear_plan(rows: int) -> Int8LinearPlan:
    """Few rows (a draft depth: 1-64): narrow strips of N, so even a 4,096-wide output makes 128 programs, and
    long K steps; many rows (a prompt's ingest): square-ish tiles that reuse each loaded strip more."""
    if rows <= 64:
        return Int8LinearPlan(max(16, triton.next_power_of_2(rows)), 32, 256, num_warps=4, num_stages=4)
    return Int8LinearPlan(64, 64, 64, num_warps=4, num_stages=3)


@triton.jit(do_not_specialize=["M"])  # the row count moves from call to call: one compile for all of them
def _int8_linear_kernel(
    x_ptr,  # [M, K] float (bf16 / fp16 / fp32), row stride x_stride, unit column stride
    q_ptr,  # [N, K] int8, contiguous
    scale_ptr,  # [N] float32
    out_ptr,  # [M, N] x's dtype, contiguous
    M, N, K, x_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    m_tile, n_tile = tl.program_id(0), tl.program_id(1)  # M tiles vary fastest: one strip's tiles run together
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride  # [BLOCK_M, 1]
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(q_rows + ks[None, :], mask=col_in[:, None] & k_in[None, :], other=0)  # [BLOCK_N, BLOCK_K] int8
        w = q.to(tl.float32).to(x.dtype)  # through fp32: exact, and what a GPU's conversion does anyway
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    scale = tl.load(scale_ptr + cols, mask=col_in, other=0.0)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], out, mask=row_in[:, None] & col_in[None, :])


def int8_linear_triton(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, plan: Int8LinearPlan | None = None
) -> torch.Tensor:
    """x [..., K] (unit stride along K), q [N, K] int8 contiguous, scale [N] float32 -> [..., N] in x's dtype.
    ``plan``: the tiling (default ``int8_linear_plan`` of the row count; the benchmark sweeps others)."""
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
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        plan = plan or int8_linear_plan(rows.shape[0])
        grid = (triton.cdiv(rows.shape[0], plan.block_m), triton.cdiv(n, plan.block_n))
        _int8_linear_kernel[grid](
            rows, q, scale, out, rows.shape[0], n, k, rows.stride(0),
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, IEEE=x.dtype == torch.float32,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )  # fmt: skip
    return out.view(*x.shape[:-1], n)

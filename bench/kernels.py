"""Tree-attention kernel benchmark: Triton vs the PyTorch reference vs SDPA, at long context.

Run from the repo root on a GPU: ``PYTHONPATH=. python3 bench/kernels.py [--out PATH] [--sweep]``.

For each attention shape, context length L and tree size T (batch 1, page 16 unless ``--page-size``, bf16): the median
time of one layer's tree attention, the KV bytes it must read over that time as a fraction of the
device-to-device copy bandwidth measured in the same run (bytes read + written / time), its speedup
over ``tree_attention_reference`` and over SDPA on a contiguous copy of the same keys/values with a
dense bool mask, time(T) / time(T=1), its TFLOP/s against a dense bf16 matmul's measured in the same run,
and its time against the roofline: the longer of reading the KV at the copy bandwidth and doing its FLOPs
at that matmul rate. The Triton kernel is timed as it is served, in CUDA-graph
replays of back-to-back calls that rotate among KV copies larger than L2 together (cold L2 for every
call, no launch gaps); also with ``triton.testing.do_bench``, which zeroes 256 MB before every call
and so makes each call pay the write-back of that buffer's dirty L2 lines. ``--sweep`` also times
alternative launch plans at each context length of the table, to tune ``plan_tree_attention``.

The draft head's attention (``diffspec_kernels/draft_attention_triton.py``) at the same 8B shape, B sessions of
n = 10 frontier rows over a full context of L keys plus m = 64 tree entries: its time (as served, the
same cold-L2 graph replays), the reference's, and the bandwidth floor: the context's bytes over the copy
bandwidth measured in this run. ``--draft-only`` skips the tree attention.

``--page-size`` times the tree attention over KV pages of another size (the serving pool's ``page_size``): a
64-key tile then reads one page's consecutive keys rather than gathering four pages' through the block table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable
import pathlib
import sys
from dataclasses import dataclass

# Run as a script, this file's folder heads sys.path and its name would shadow the `kernels` package.
sys.path = [p for p in sys.path if pathlib.Path(p or ".").resolve() != pathlib.Path(__file__).resolve().parent]

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from diffspec.tree import DraftTree
from diffspec_kernels.attention_metadata import AttentionMetadata
from diffspec_kernels.draft_attention_ref import draft_attention_reference
from diffspec_kernels.draft_attention_triton import run_draft_attention
from diffspec_kernels.draft_attention_triton import default_plan as draft_default_plan
from diffspec_kernels.tree_attention_ref import gather_context, tree_attention_reference
from diffspec_kernels.tree_attention_triton import TreeAttentionPlan, default_plan, run_tree_attention

PAGE_SIZE = 16  # the serving pool's default
CONTEXT_LENS = (4096, 16384, 65536, 131072)
TREE_SIZES = (1, 16, 32, 64)
DRAFT_BATCHES, DRAFT_CONTEXT_LENS, DRAFT_QUERIES, DRAFT_NEW_ENTRIES = (1, 16), (2048, 16384, 65536), 10, 64


@dataclass(frozen=True)
class Shape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = (Shape("llama-3.1-8b", 32, 8, 128), Shape("bench-code", 3, 3, 128))


@dataclass(frozen=True)
class Problem:
    q: torch.Tensor  # [T, num_heads, head_dim]
    k_new: torch.Tensor  # [T, num_kv_heads, head_dim]
    v_new: torch.Tensor  # [T, num_kv_heads, head_dim]
    k_pages: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    mask: torch.Tensor  # [T, T] bool tree mask
    scale: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_new, self.v_new, self.k_pages, self.v_pages

    @property
    def kv_bytes(self) -> int:
        """Bytes of committed K and V the kernel must read (the new tokens' are negligible)."""
        ctx = int(self.meta.context_lens_t[0])
        return 2 * ctx * self.k_pages.shape[2] * self.k_pages.shape[3] * self.k_pages.element_size()


def make_problem(shape: Shape, context_len: int, tree_size: int, page_size: int = PAGE_SIZE, seed: int = 0) -> Problem:
    cpu = torch.Generator().manual_seed(seed)
    num_pages = context_len // page_size
    table = torch.randperm(num_pages, generator=cpu).tolist()
    mask = DraftTree.random(tree_size, cpu).ancestor_mask()
    device = torch.device("cuda")
    meta = AttentionMetadata.build([tree_size], [context_len], [table], [mask], page_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=torch.bfloat16)

    kv = (shape.num_kv_heads, shape.head_dim)
    return Problem(
        q=randn(tree_size, shape.num_heads, shape.head_dim),
        k_new=randn(tree_size, *kv),
        v_new=randn(tree_size, *kv),
        k_pages=randn(num_pages, page_size, *kv),
        v_pages=randn(num_pages, page_size, *kv),
        meta=meta,
        mask=mask.to(device),
        scale=shape.head_dim**-0.5,
    )


def median_ms(fn, rep_ms: int = 100) -> float:
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB of random data: (bytes read + bytes written) / s.

    Not graph-captured: captured, copy_ became a memcpy node that ran at 2.77 TB/s on an H200, against
    4.25 TB/s launched directly (the L2 flush is noise beside 2 GiB of traffic).
    """
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_peak() -> float:
    """Dense bf16 matmul, 8192 x 8192 x 8192 (cuBLAS): FLOP/s, the compute ceiling a row is held against."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3)


def sdpa_inputs(problem: Problem) -> tuple[torch.Tensor, ...]:
    """q [1, H, T, D] and contiguous K/V [1, H, L + T, D] (kv heads repeated for the group), mask [T, L + T]."""
    ctx, tree = int(problem.meta.context_lens_t[0]), problem.q.shape[0]
    group = problem.q.shape[1] // problem.k_new.shape[1]

    def dense(pages: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        full = torch.cat([gather_context(pages, problem.meta.block_tables[0], ctx), new])  # [L + T, H_kv, D]
        return full.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

    visible = torch.ones(tree, ctx + tree, dtype=torch.bool, device=problem.q.device)
    visible[:, ctx:] = problem.mask
    q = problem.q.transpose(0, 1).unsqueeze(0).contiguous()
    return q, dense(problem.k_pages, problem.k_new), dense(problem.v_pages, problem.v_new), visible


def time_cold_l2(
    run: Callable[[torch.Tensor, torch.Tensor], object], k: torch.Tensor, v: torch.Tensor, rep_ms: int
) -> float:
    """Median per-call time of CUDA-graph replays of back-to-back ``run(k, v)`` calls (as served), rotating among
    copies of k and v that together exceed L2 three times over, so every call reads them from device memory."""
    l2_bytes = getattr(torch.cuda.get_device_properties(), "L2_cache_size", 60 << 20)
    num_copies = max(2, -(-3 * l2_bytes // (2 * k.numel() * k.element_size())))
    rotation = itertools.cycle([(k, v)] + [(k.clone(), v.clone()) for _ in range(num_copies - 1)])
    return do_bench_cudagraph(lambda: run(*next(rotation)), rep=rep_ms, return_mode="median")


def time_triton(problem: Problem, plan: TreeAttentionPlan, rep_ms: int = 20) -> float:
    """``time_cold_l2`` over the KV pages."""
    out = torch.empty_like(problem.q)
    new_kv = (problem.q, problem.k_new, problem.v_new)
    return time_cold_l2(
        lambda k_pages, v_pages: run_tree_attention(*new_kv, k_pages, v_pages, problem.meta, problem.scale, plan, out),
        problem.k_pages, problem.v_pages, rep_ms,
    )  # fmt: skip


def time_triton_l2_flushed(problem: Problem, plan: TreeAttentionPlan) -> float:
    """do_bench's own way: one launch at a time after zeroing 256 MB, whose dirty lines L2 then writes back
    during the timed call (about +50 MB of traffic, which weighs on the short calls)."""
    out = torch.empty_like(problem.q)
    return median_ms(lambda: run_tree_attention(*problem.tensors(), problem.meta, problem.scale, plan, out))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_case(
    shape: Shape, context_len: int, tree_size: int, page_size: int, copy_bytes_per_s: float, matmul_flops: float
) -> dict:
    """One row; its roofline is the longer of reading the KV at copy bandwidth and its FLOPs at the matmul peak,
    both measured in this run."""
    problem = make_problem(shape, context_len, tree_size, page_size)
    plan = default_plan(problem.q, problem.k_new, problem.meta)
    triton_ms = time_triton(problem, plan)
    flushed_ms = time_triton_l2_flushed(problem, plan)
    out = torch.empty_like(problem.q)
    run_tree_attention(*problem.tensors(), problem.meta, problem.scale, plan, out)
    ref_ms = median_ms(lambda: tree_attention_reference(*problem.tensors(), problem.meta, problem.scale), rep_ms=50)
    ref = tree_attention_reference(*(t.float() for t in problem.tensors()), problem.meta, problem.scale)
    q, k, v, visible = sdpa_inputs(problem)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=problem.scale), 50)
    sdpa_out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=problem.scale)[0].transpose(0, 1)
    bytes_per_s = problem.kv_bytes / (triton_ms * 1e-3)
    flops = 4 * tree_size * shape.num_heads * shape.head_dim * context_len  # q.k and p.v over the context
    roofline_ms = 1e3 * max(problem.kv_bytes / copy_bytes_per_s, flops / matmul_flops)
    return {
        "shape": shape.name,
        "num_heads": shape.num_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "context_len": context_len,
        "tree_size": tree_size,
        "page_size": page_size,
        "plan": dataclasses.asdict(plan),
        "kv_bytes": problem.kv_bytes,
        "triton_us": triton_ms * 1e3,
        "triton_us_l2_flushed": flushed_ms * 1e3,
        "kv_read_gb_per_s": bytes_per_s / 1e9,
        "fraction_of_copy_bw": bytes_per_s / copy_bytes_per_s,
        "reference_us": ref_ms * 1e3,
        "speedup_vs_reference": ref_ms / triton_ms,
        "sdpa_us": sdpa_ms * 1e3,
        "speedup_vs_sdpa": sdpa_ms / triton_ms,
        "rel_err_vs_fp32_reference": relative_error(out, ref),
        "rel_err_sdpa_vs_fp32_reference": relative_error(sdpa_out, ref),
        "tflop_per_s": flops / (triton_ms * 1e-3) / 1e12,
        "fraction_of_matmul_peak": flops / (triton_ms * 1e-3) / matmul_flops,
        "roofline_us": roofline_ms * 1e3,
        "fraction_of_roofline": roofline_ms / triton_ms,
    }


def bench_draft_attention(batch: int, context_len: int, copy_bytes_per_s: float) -> dict:
    """The draft head's attention at the Llama-3.1-8B shape, every session's context full (lengths = L)."""
    shape, device = SHAPES[0], torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(batch * context_len)

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen, device=device, dtype=torch.bfloat16)

    kv = (shape.num_kv_heads, shape.head_dim)
    q = randn(batch, DRAFT_QUERIES, shape.num_heads, shape.head_dim)
    ctx_k, ctx_v = randn(batch, context_len, *kv), randn(batch, context_len, *kv)
    new_k, new_v = randn(batch, DRAFT_NEW_ENTRIES, *kv), randn(batch, DRAFT_NEW_ENTRIES, *kv)
    new_mask = torch.rand(batch, DRAFT_QUERIES, DRAFT_NEW_ENTRIES, generator=gen, device=device) < 0.5
    lengths = torch.full((batch,), context_len, dtype=torch.int64, device=device)
    scale = shape.head_dim**-0.5
    plan = draft_default_plan(q, ctx_k, new_k)
    out = torch.empty_like(q)

    def run(k: torch.Tensor, v: torch.Tensor) -> None:
        run_draft_attention(q, k, v, new_k, new_v, new_mask, scale, lengths, plan, out)

    triton_ms = time_cold_l2(run, ctx_k, ctx_v, rep_ms=20)
    run(ctx_k, ctx_v)
    args = (q, ctx_k, ctx_v, new_k, new_v, new_mask, scale, lengths)
    ref_ms = median_ms(lambda: draft_attention_reference(*args), rep_ms=50)
    fp32 = (t.float() for t in (q, ctx_k, ctx_v, new_k, new_v))
    ref = draft_attention_reference(*fp32, new_mask, scale, lengths)
    context_bytes = 2 * ctx_k.numel() * ctx_k.element_size()
    floor_ms = context_bytes / copy_bytes_per_s * 1e3
    return {
        "batch": batch,
        "context_len": context_len,
        "num_queries": DRAFT_QUERIES,
        "num_new": DRAFT_NEW_ENTRIES,
        "plan": dataclasses.asdict(plan),
        "context_bytes": context_bytes,
        "triton_us": triton_ms * 1e3,
        "reference_us": ref_ms * 1e3,
        "speedup_vs_reference": ref_ms / triton_ms,
        "floor_us": floor_ms * 1e3,
        "fraction_of_copy_bw": floor_ms / triton_ms,
        "rel_err_vs_fp32_reference": relative_error(out, ref),
    }


def plan_variants(base: TreeAttentionPlan, rows: int) -> list[TreeAttentionPlan]:
    """The launch plans a sweep times around ``base`` for ``rows`` query rows per KV head, ``base`` first and
    none twice: its key tiles, stages and split counts; from 128 rows, row tiles of 64 and 128 over 4 and 8
    warps (a program per SM or two); past ``base``'s row tile, one 256-row tile instead of several."""
    block_ns = (32, 64, 128) if base.block_m >= 128 else (64, 128)
    split_counts = sorted({max(1, base.num_splits // 2), base.num_splits, 2 * base.num_splits})
    plans = [base] + [
        dataclasses.replace(base, block_n=block_n, num_stages=num_stages, num_splits=num_splits)
        for block_n, num_stages, num_splits in itertools.product(block_ns, (2, 3, 4), split_counts)
    ]
    if rows >= 128:
        plans += [
            dataclasses.replace(base, block_m=block_m, num_warps=num_warps, block_n=block_n, num_splits=num_splits)
            for block_m, num_warps, block_n, num_splits in itertools.product((64, 128), (4, 8), (64, 128), split_counts)
        ]
    if rows > base.block_m:  # several row tiles re-read the KV
        plans += [
            dataclasses.replace(base, block_m=256, num_warps=num_warps, block_n=block_n, num_stages=num_stages)
            for num_warps, block_n, num_stages in itertools.product((8, 16), (32, 64), (2, 3))
        ]
    return list(dict.fromkeys(plans))


def sweep_plans(shape: Shape, context_len: int, tree_size: int, page_size: int, copy_bytes_per_s: float) -> list[dict]:
    """Time ``plan_variants`` of the default plan at ``context_len`` keys."""
    problem = make_problem(shape, context_len, tree_size, page_size)
    base = default_plan(problem.q, problem.k_new, problem.meta)
    plans = plan_variants(base, tree_size * shape.num_heads // shape.num_kv_heads)
    results = []
    for plan in plans:
        result = {"shape": shape.name, "context_len": context_len, "tree_size": tree_size}
        result |= {"plan": dataclasses.asdict(plan), "is_default": plan == base}
        try:
            ms = time_triton(problem, plan)
        except triton.runtime.errors.OutOfResources as error:
            results.append({**result, "error": str(error)})
            continue
        fraction = problem.kv_bytes / (ms * 1e-3) / copy_bytes_per_s
        results.append({**result, "triton_us": ms * 1e3, "fraction_of_copy_bw": fraction})
    return results


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':<13}{'L':>7}{'T':>4}{'splits':>7}{'triton_us':>10}{'GB/s':>7}{'%copy':>7}{'flush_us':>9}"
        f"{'ref_us':>10}{'x_ref':>7}{'sdpa_us':>10}{'x_sdpa':>7}{'T/T1':>6}{'TF/s':>6}{'%peak':>7}{'%roof':>7}{'err':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['shape']:<13}{r['context_len']:>7}{r['tree_size']:>4}{r['plan']['num_splits']:>7}"
            f"{r['triton_us']:>10.1f}{r['kv_read_gb_per_s']:>7.0f}{100 * r['fraction_of_copy_bw']:>6.1f}%"
            f"{r['triton_us_l2_flushed']:>9.1f}"
            f"{r['reference_us']:>10.0f}{r['speedup_vs_reference']:>7.1f}{r['sdpa_us']:>10.0f}"
            f"{r['speedup_vs_sdpa']:>7.1f}{r['time_vs_tree_size_1']:>6.2f}{r['tflop_per_s']:>6.0f}"
            f"{100 * r['fraction_of_matmul_peak']:>6.1f}%{100 * r['fraction_of_roofline']:>6.1f}%"
            f"{r['rel_err_vs_fp32_reference']:>9.1e}"
        )


def print_draft_table(rows: list[dict]) -> None:
    print(f"{'draft B':<8}{'L':>7}{'splits':>7}{'triton_us':>10}{'floor_us':>9}{'%copy':>7}{'ref_us':>10}{'x_ref':>7}{'err':>9}")
    for r in rows:
        print(
            f"{r['batch']:<8}{r['context_len']:>7}{r['plan']['num_splits']:>7}{r['triton_us']:>10.1f}"
            f"{r['floor_us']:>9.1f}{100 * r['fraction_of_copy_bw']:>6.1f}%{r['reference_us']:>10.0f}"
            f"{r['speedup_vs_reference']:>7.1f}{r['rel_err_vs_fp32_reference']:>9.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/kernels.json"))
    parser.add_argument("--sweep", action="store_true", help="also time launch-plan variants at each context length")
    parser.add_argument("--context-lens", type=int, nargs="+", default=CONTEXT_LENS)
    parser.add_argument("--tree-sizes", type=int, nargs="+", default=TREE_SIZES, help="include 1: rows report T/T1")
    parser.add_argument("--draft-only", action="store_true", help="time only the draft head's attention")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES],
                        help="attention shapes of the table and the sweep")
    parser.add_argument("--page-size", type=int, default=PAGE_SIZE,
                        help="tokens per KV page of the tree attention's table and sweep (a power of two)")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if s.name in args.shapes]

    copy_bytes_per_s, matmul_flops = copy_bandwidth(), matmul_peak()
    rows = []
    for shape in () if args.draft_only else shapes:
        for context_len in args.context_lens:
            for tree_size in args.tree_sizes:
                rows.append(bench_case(shape, context_len, tree_size, args.page_size, copy_bytes_per_s, matmul_flops))
                base = next(r for r in rows if r["shape"] == shape.name and r["context_len"] == context_len)
                rows[-1]["time_vs_tree_size_1"] = rows[-1]["triton_us"] / base["triton_us"]
                torch.cuda.empty_cache()
    draft_rows = []
    for batch in DRAFT_BATCHES:
        for context_len in DRAFT_CONTEXT_LENS:
            draft_rows.append(bench_draft_attention(batch, context_len, copy_bytes_per_s))
            torch.cuda.empty_cache()
    sweep = []
    if args.sweep:
        for shape, context_len, tree_size in itertools.product(shapes, args.context_lens, args.tree_sizes):
            swept = sweep_plans(shape, context_len, tree_size, args.page_size, copy_bytes_per_s)
            sweep += swept
            timed = [s for s in swept if "triton_us" in s]
            best = min(timed, key=lambda s: s["triton_us"])
            default = next(s for s in timed if s["is_default"])
            print(
                f"sweep {shape.name} L={context_len} T={tree_size}: default {default['triton_us']:.1f} us, "
                f"best {best['triton_us']:.1f} us {best['plan']}",
                flush=True,
            )

    print(
        f"device {torch.cuda.get_device_name()}, copy bandwidth {copy_bytes_per_s / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {matmul_flops / 1e12:.0f} TFLOP/s"
    )
    if rows:
        print_table(rows)
    print_draft_table(draft_rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "page_size": args.page_size,
        "dtype": "bfloat16",
        "copy_bandwidth_tb_per_s": copy_bytes_per_s / 1e12,
        "matmul_tflop_per_s": matmul_flops / 1e12,
        "timing": (
            "triton_us: median of do_bench_cudagraph replays, KV rotated among copies > 3x L2; triton_us_l2_flushed, "
            "reference_us, sdpa_us: do_bench median, L2 flushed before each call; SDPA on KV heads repeated to the "
            "query heads, its default backend"
        ),
        "rows": rows,
        "draft_rows": draft_rows,
        "sweep": sweep,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

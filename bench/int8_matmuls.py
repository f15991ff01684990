"""The draft head's per-depth matmuls at serving's row counts: cuBLAS on the head's dtype against the int8 kernel.

A draft depth at small batch is bound by the weight bytes it reads, so each matmul is held against the
copy bandwidth measured in the same run: ``% copy bandwidth`` = weight bytes / time / that bandwidth
(a matmul only reads its weights, a copy reads and writes, so 100% is not a hard ceiling). Rows: 1 (one
chain), 10 (one session's frontier of the full tree), 64, 160 (16 sessions' frontiers) and 1,024 (a
prompt's ingest). Times are medians of ``triton.testing.do_bench`` with L2 cleared before each call.
With ``--sweep``, every tiling of ``plan_variants`` runs at each shape of up to 160 rows and the best is
kept.

    python -m bench.int8_matmuls --base-model /tmp/b8/target --draft-model /tmp/b8/head --out bench/results/int8_matmuls_8b.json
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.draft_times import head_parser, parse_with_gpu_head, write_rows
from bench.kernels import copy_bandwidth, median_ms
from draft_service.serving_weights import ServingLinear, ServingWeights, auto_multiplies_in_int8

ROWS = (1, 10, 64, 160, 1024)
SWEPT_ROWS = 160  # the sweep's largest row count: 16 sessions' frontiers (an ingest's 1,024 rows are cuBLAS's)


def named_linears(weights: ServingWeights) -> dict[str, ServingLinear]:
    """Layer 0's four matmuls and the vocabulary head, by name (deeper layers repeat layer 0's shapes)."""
    first = weights.layers[0]
    return {"qkv": first.qkv, "o": first.o, "gate_up": first.gate_up, "down": first.down, "lm_head": weights.lm_head}


def plan_variants(rows: int) -> list:
    """Tilings for ``rows``: up to 16 rows (a batch-1 depth) one M tile with every strip of N, step of K, warp
    count, stage count and K split; more rows (a batch's frontiers) M tiles of 16 to 64 rows with the shorter K steps
    that keep their operand tiles in registers."""
    from diffspec_kernels.int8_linear_triton import Int8LinearPlan

    if rows <= 16:
        return [
            Int8LinearPlan(16, n, k, warps, stages, split_k)
            for n, k, warps, stages, split_k in itertools.product(
                (16, 32, 64), (128, 256, 512), (4, 8), (3, 4), (1, 2, 4)
            )
        ]
    return [
        Int8LinearPlan(m, n, k, warps, 3)
        for m, n, k, warps in itertools.product((16, 32, 64), (32, 64), (64, 128), (4, 8))
    ]


def measure(name: str, dense: ServingLinear, int8: ServingLinear, rows: int, bandwidth: float, sweep: bool) -> dict:
    from diffspec_kernels.int8_linear_triton import int8_linear_plan, int8_linear_triton
    from diffspec_kernels.split_plan import sm_count

    out_features, in_features = dense.weight.shape
    x = torch.randn(rows, in_features, device=dense.weight.device, dtype=dense.weight.dtype)
    want = F.linear(x.float(), int8.weight.float()) * int8.scale
    got = int8_linear_triton(x, int8.weight, int8.scale)
    error = float((got.float() - want).abs().max() / want.abs().max())
    dense_ms = median_ms(lambda: F.linear(x, dense.weight))
    int8_ms = median_ms(lambda: int8_linear_triton(x, int8.weight, int8.scale))
    row = {
        "matmul": name, "out": out_features, "in": in_features, "rows": rows,
        "dense_us": round(1e3 * dense_ms, 1), "int8_us": round(1e3 * int8_ms, 1),
        "int8_speedup": round(dense_ms / int8_ms, 2),
        "dense_pct_copy_bandwidth": round(100 * dense.nbytes / (dense_ms * 1e-3) / bandwidth, 1),
        "int8_pct_copy_bandwidth": round(100 * int8.nbytes / (int8_ms * 1e-3) / bandwidth, 1),
        "int8_relative_error": round(error, 6),
        "plan": vars(int8_linear_plan(rows, out_features, in_features, sm_count(x.device))),
    }  # fmt: skip
    if sweep and rows <= SWEPT_ROWS:
        timed = [(median_ms(lambda p=p: int8_linear_triton(x, int8.weight, int8.scale, p), rep_ms=20), p)
                 for p in plan_variants(rows)]  # fmt: skip
        best_ms, best = min(timed, key=lambda t: t[0])
        row["sweep_best_us"], row["sweep_best_plan"] = round(1e3 * best_ms, 1), vars(best)
    return row


def depth_totals(rows: list[dict]) -> list[dict]:
    """Per row count, a depth's five matmuls summed (us): cuBLAS on the head's dtype, int8 everywhere, ``auto``'s
    mix (``auto_multiplies_in_int8``: int8 for the large matrices at few rows) and,
    after a sweep, int8 at each matmul's best tiling."""
    totals = []
    for count in sorted({r["rows"] for r in rows}):
        mine = [r for r in rows if r["rows"] == count]
        in_int8 = [auto_multiplies_in_int8(r["out"] * r["in"], count) for r in mine]
        total = {
            "rows": count,
            "dense_us": round(sum(r["dense_us"] for r in mine), 1),
            "int8_us": round(sum(r["int8_us"] for r in mine), 1),
            "auto_us": round(sum(r["int8_us"] if int8 else r["dense_us"] for r, int8 in zip(mine, in_int8)), 1),
        }
        if all("sweep_best_us" in r for r in mine):
            total["int8_sweep_best_us"] = round(sum(r["sweep_best_us"] for r in mine), 1)
        totals.append(total)
    return totals


def plot(rows: list[dict], path: Path) -> None:
    """Per row count: % of the copy bandwidth each matmul reaches, cuBLAS against int8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["rows"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(3.2 * len(counts), 3.6), squeeze=False, sharey=True)
    for ax, count in zip(axes[0], counts):
        mine = [r for r in rows if r["rows"] == count]
        names = [r["matmul"] for r in mine]
        at = range(len(mine))
        ax.bar([i - 0.2 for i in at], [r["dense_pct_copy_bandwidth"] for r in mine], 0.4, label="cuBLAS, head dtype")
        ax.bar([i + 0.2 for i in at], [r["int8_pct_copy_bandwidth"] for r in mine], 0.4, label="int8 kernel")
        ax.set_xticks(list(at), names, rotation=45, fontsize=7)
        ax.set_title(f"{count} rows")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("% of copy bandwidth (weight bytes / time)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = head_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--sweep", action="store_true", help="time every tiling up to 160 rows; keep the best")
    args, head = parse_with_gpu_head(parser)
    dense, int8 = named_linears(head.serving_weights("none")), named_linears(head.serving_weights("int8"))
    bandwidth = copy_bandwidth()
    rows = []
    for count in args.rows:
        for name in dense:
            row = measure(name, dense[name], int8[name], count, bandwidth, args.sweep)
            print(json.dumps(row), flush=True)
            rows.append(row)
    for total in depth_totals(rows):
        print(f"a depth's five matmuls: {json.dumps(total)}")
    write_rows(rows, bandwidth, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

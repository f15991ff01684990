"""The int8 matmul benchmark's pieces that run anywhere: its shapes and every tiling it sweeps."""

from __future__ import annotations

import pytest
import torch

from bench.int8_matmuls import depth_totals, named_linears, plan_variants
from diffspec_kernels.int8_linear_ref import int8_linear_reference, quantize_int8
from tests.draft_service.test_eagle3_head import random_head

int8_linear_triton = pytest.importorskip("diffspec_kernels.int8_linear_triton")


def test_the_named_matmuls_are_a_depth_s_matmuls():
    weights = random_head().serving_weights("int8")
    named = named_linears(weights)
    assert list(named) == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert sum(linear.nbytes for linear in named.values()) == weights.bytes_per_depth  # a one-layer head


@pytest.mark.interpreted
@pytest.mark.parametrize("rows, variants", [(10, 108), (40, 24)], ids=["one tile", "many rows"])
def test_every_swept_tiling_gives_the_reference_result(rows, variants):
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_int8(torch.randn(40, 300, generator=gen))
    x = torch.randn(rows, 300, generator=gen)
    want = int8_linear_reference(x, q, scale)
    plans = plan_variants(rows)
    assert len(set(plans)) == len(plans) == variants
    assert all(p.block_m == 16 for p in plans) or rows > 16
    for plan in plans:
        got = int8_linear_triton.int8_linear_triton(x, q, scale, plan)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_a_depth_s_totals_sum_each_mode_s_matmuls():
    """``auto`` takes int8 for the large matrices up to 16 rows and the head's dtype for the rest."""

    def row(name: str, out: int, inp: int, rows: int, dense: float, int8: float, best: float | None) -> dict:
        found = {"matmul": name, "out": out, "in": inp, "rows": rows, "dense_us": dense, "int8_us": int8}
        return found if best is None else {**found, "sweep_best_us": best}

    rows = [
        row("qkv", 6144, 8192, 1, 36.8, 28.0, 20.0), row("o", 4096, 4096, 1, 18.8, 31.1, 12.0),
        row("qkv", 6144, 8192, 64, 37.2, 119.3, None), row("o", 4096, 4096, 64, 19.6, 111.0, None),
    ]  # fmt: skip
    assert depth_totals(rows) == [
        {"rows": 1, "dense_us": 55.6, "int8_us": 59.1, "auto_us": 46.8, "int8_sweep_best_us": 32.0},
        {"rows": 64, "dense_us": 56.8, "int8_us": 230.3, "auto_us": 56.8},
    ]

"""Tree attention: the PyTorch reference against a naive softmax (CPU), the Triton kernel against the reference
(GPU, and small cases on CPU under the Triton interpreter), its launch plan's shared memory, and its input checks."""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from diffspec.tree import DraftTree
from diffspec_kernels.attention_metadata import AttentionMetadata, causal_mask
from diffspec_kernels.split_plan import SplitKVPlan
from diffspec_kernels.tree_attention_ref import tree_attention_reference
from tests.diffspec_kernels.kernel_cases import kernel_cases


@dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]  # [batch] new tokens per sequence
    context_lens: tuple[int, ...]  # [batch] committed tokens per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"T{'-'.join(map(str, self.q_lens))}_L{'-'.join(map(str, self.context_lens))}"
            f"_H{self.num_heads}/{self.num_kv_heads}_D{self.head_dim}_page{self.page_size}_{dtype}"
        )


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # [total_q, num_heads, head_dim]
    k_new: torch.Tensor  # [total_q, num_kv_heads, head_dim]
    v_new: torch.Tensor  # [total_q, num_kv_heads, head_dim]
    k_pages: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    v_pages: torch.Tensor  # [num_pages, page_size, num_kv_heads, head_dim]
    meta: AttentionMetadata
    block_tables: list[list[int]]  # [batch][pages of the sequence]
    masks: list[torch.Tensor]  # [batch] of [q_len, q_len] bool

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_new, self.v_new, self.k_pages, self.v_pages


def make_inputs(case: Case, device: str, seed: int) -> Inputs:
    """Random (never zero) inputs; each sequence's pages are a random permutation of the pool, with spare pages."""
    cpu = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-ctx // case.page_size) for ctx in case.context_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=cpu).tolist()
    block_tables, used = [], 0
    for n in pages_per_seq:
        block_tables.append(order[used : used + n])
        used += n
    masks = [DraftTree.random(q_len, cpu).ancestor_mask() for q_len in case.q_lens]
    meta = AttentionMetadata.build(
        list(case.q_lens), list(case.context_lens), block_tables, masks, case.page_size, torch.device(device)
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    total_q, kv_heads, dim = sum(case.q_lens), case.num_kv_heads, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(case.dtype)

    return Inputs(
        q=randn(total_q, case.num_heads, dim),
        k_new=randn(total_q, kv_heads, dim),
        v_new=randn(total_q, kv_heads, dim),
        k_pages=randn(num_pages, case.page_size, kv_heads, dim),
        v_pages=randn(num_pages, case.page_size, kv_heads, dim),
        meta=meta,
        block_tables=block_tables,
        masks=masks,
    )


def naive_tree_attention(inputs: Inputs, scale: float) -> torch.Tensor:
    """float64, one (token, head) at a time: gather exactly the visible keys by position, softmax, weighted sum."""
    q, k_new, v_new, k_pages, v_pages = (t.double() for t in inputs.tensors())
    page_size, group = k_pages.shape[1], q.shape[1] // k_new.shape[1]
    out = torch.empty_like(q)
    row = 0
    for table, ctx_len, mask in zip(inputs.block_tables, inputs.meta.context_lens_t.tolist(), inputs.masks):
        ctx_slots = [(table[pos // page_size], pos % page_size) for pos in range(ctx_len)]
        for i in range(mask.shape[0]):
            new_rows = [row + j for j in range(mask.shape[0]) if mask[i, j]]
            keys = torch.stack([k_pages[p, o] for p, o in ctx_slots] + [k_new[r] for r in new_rows])  # [n, H_kv, D]
            values = torch.stack([v_pages[p, o] for p, o in ctx_slots] + [v_new[r] for r in new_rows])
            for h in range(q.shape[1]):
                probs = torch.softmax(keys[:, h // group] @ q[row + i, h] * scale, dim=0)
                out[row + i, h] = probs @ values[:, h // group]
        row += mask.shape[0]
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# -- CPU: the reference itself ------------------------------------------------------------------------

REFERENCE_CASES = [
    Case((1,), (0,), num_heads=2, num_kv_heads=2, head_dim=8, page_size=4),
    Case((5,), (1,), num_heads=4, num_kv_heads=2, head_dim=8, page_size=4),
    Case((7,), (17,), num_heads=4, num_kv_heads=1, head_dim=16, page_size=16),
    Case((6,), (100,), num_heads=8, num_kv_heads=2, head_dim=8, page_size=1),
    Case((3, 1, 8), (0, 100, 1), num_heads=4, num_kv_heads=4, head_dim=8, page_size=4),
    Case((4, 9), (17, 0), num_heads=8, num_kv_heads=2, head_dim=16, page_size=16),
    Case((2, 5), (100, 17), num_heads=4, num_kv_heads=1, head_dim=8, page_size=8),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_matches_naive_softmax(case: Case) -> None:
    inputs = make_inputs(case, "cpu", seed=zlib.crc32(str(case).encode()))
    out = tree_attention_reference(*inputs.tensors(), inputs.meta, scale=0.3)
    assert relative_error(out, naive_tree_attention(inputs, scale=0.3)) < 1e-5


def test_reference_root_token_without_context_returns_its_value() -> None:
    """One new token, no context, seeing only itself: softmax over one key is 1."""
    inputs = make_inputs(Case((1,), (0,), 4, 2, 8, 4), "cpu", seed=0)
    out = tree_attention_reference(*inputs.tensors(), inputs.meta, scale=1.0)
    assert torch.allclose(out, inputs.v_new.repeat_interleave(2, dim=1))


def test_reference_chain_equals_causal_dense_attention() -> None:
    """A chain tree is a causal prefill chunk: compare with SDPA over the gathered sequence."""
    case = Case((6,), (10,), num_heads=4, num_kv_heads=2, head_dim=8, page_size=4)
    inputs = make_inputs(case, "cpu", seed=1)
    meta = AttentionMetadata.build([6], [10], inputs.block_tables, [causal_mask(6)], 4, torch.device("cpu"))
    out = tree_attention_reference(*inputs.tensors(), meta, scale=0.5)
    slots = [(inputs.block_tables[0][p // 4], p % 4) for p in range(10)]
    keys = torch.cat([torch.stack([inputs.k_pages[p, o] for p, o in slots]), inputs.k_new])  # [16, 2, 8]
    values = torch.cat([torch.stack([inputs.v_pages[p, o] for p, o in slots]), inputs.v_new])
    visible = torch.ones(6, 16, dtype=torch.bool).tril(diagonal=10)
    dense = torch.nn.functional.scaled_dot_product_attention(
        inputs.q.transpose(0, 1),
        keys.repeat_interleave(2, dim=1).transpose(0, 1),
        values.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=visible,
        scale=0.5,
    ).transpose(0, 1)
    assert relative_error(out, dense) < 1e-5


# -- The Triton kernel against the reference: the full set on a GPU, small cases interpreted on CPU ------

B16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
GPU_CASES = [
    Case((1,), (1,), num_heads=8, num_kv_heads=8, head_dim=64, page_size=16, dtype=B16),
    Case((1, 1, 1), (17, 1000, 4096), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((8,), (17,), num_heads=4, num_kv_heads=4, head_dim=128, page_size=64, dtype=F16),
    Case((8, 3), (1000, 0), num_heads=32, num_kv_heads=4, head_dim=64, page_size=16, dtype=B16),
    Case((8,), (0,), num_heads=32, num_kv_heads=8, head_dim=64, page_size=16, dtype=B16),
    Case((32,), (4096,), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((32, 17, 5), (1000, 17, 4096), num_heads=8, num_kv_heads=8, head_dim=64, page_size=64, dtype=F16),
    Case((64,), (65536,), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((64, 2), (4096, 1), num_heads=16, num_kv_heads=2, head_dim=128, page_size=64, dtype=B16),
    Case((128,), (1000,), num_heads=32, num_kv_heads=4, head_dim=64, page_size=16, dtype=F16),
    Case((128, 64), (17, 4096), num_heads=4, num_kv_heads=4, head_dim=128, page_size=16, dtype=B16),
    Case((16,), (65536,), num_heads=64, num_kv_heads=8, head_dim=128, page_size=64, dtype=F16),
    Case((1, 8, 64), (65536, 1000, 17), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((128,), (65536,), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((1,), (131072,), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=B16),
    Case((64,), (131072,), num_heads=3, num_kv_heads=3, head_dim=128, page_size=64, dtype=B16),
    Case((8, 32), (131072, 4096), num_heads=32, num_kv_heads=4, head_dim=64, page_size=64, dtype=F16),
    Case((64, 2048), (4096, 0), num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=F32),  # fp32 replay's prefill
]
TRITON_CASES = kernel_cases(
    gpu=GPU_CASES,
    # No bf16: the Triton 3.6 interpreter multiplies bf16 tl.dot operands as their raw 16-bit patterns.
    interpreted=[
        Case((1,), (1,), num_heads=2, num_kv_heads=2, head_dim=16, page_size=4, dtype=F32),
        Case((4, 1), (0, 37), num_heads=4, num_kv_heads=2, head_dim=32, page_size=8, dtype=F16),
        Case((3, 6), (150, 9), num_heads=2, num_kv_heads=1, head_dim=16, page_size=16, dtype=F32),  # a full key tile
    ],
)


def skip_if_interpreter_breaks_loops(device: str) -> None:
    """Triton 3.6's interpreter cannot loop up to a loaded scalar under NumPy >= 2.4 (triton-lang/triton#9171,
    fixed after 3.6); the dev extra pins numpy below 2.4."""
    if device == "cpu" and tuple(int(part) for part in np.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"Triton 3.6 interpreter loops need numpy < 2.4, found {np.__version__}")


# Below NumPy 2.4 the interpreter's conversion behind that error only warns, once per loop.
interpreter_loop_warning = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@interpreter_loop_warning
@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_matches_reference(kernel_device: str, case: Case) -> None:
    triton_attention = pytest.importorskip("diffspec_kernels.tree_attention_triton")
    skip_if_interpreter_breaks_loops(kernel_device)
    inputs = make_inputs(case, kernel_device, seed=zlib.crc32(str(case).encode()))
    scale = case.head_dim**-0.5
    ref = tree_attention_reference(*(t.float() for t in inputs.tensors()), inputs.meta, scale)
    plan = triton_attention.default_plan(inputs.q, inputs.k_new, inputs.meta)
    outs = []
    for _ in range(2):  # twice into NaN-poisoned buffers: every element written, bitwise the same both times
        out = torch.full_like(inputs.q, float("nan"))
        triton_attention.run_tree_attention(*inputs.tensors(), inputs.meta, scale, plan, out)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[0], ref) < 1e-2
    assert torch.equal(triton_attention.tree_attention_triton(*inputs.tensors(), inputs.meta, scale), outs[0])


SPLIT_CASES = kernel_cases(
    gpu=[
        (Case((5, 12), (300, 45), num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=B16), 64, num_splits)
        for num_splits in [1, 7, 64]
    ],
    interpreted=[
        (Case((3, 5), (70, 9), num_heads=4, num_kv_heads=2, head_dim=16, page_size=8, dtype=F16), 16, num_splits)
        for num_splits in [1, 3, 16]
    ],
)


@interpreter_loop_warning
@pytest.mark.parametrize("case, block_n, num_splits", SPLIT_CASES)
def test_triton_any_split_count_matches_reference(
    kernel_device: str, case: Case, block_n: int, num_splits: int
) -> None:
    """Split count changes only the order of summation: empty splits (most of them at the largest count: the
    prefix is cut into block_n-aligned shares) and one split both work."""
    triton_attention = pytest.importorskip("diffspec_kernels.tree_attention_triton")
    skip_if_interpreter_breaks_loops(kernel_device)
    inputs = make_inputs(case, kernel_device, seed=num_splits)
    ref = tree_attention_reference(*(t.float() for t in inputs.tensors()), inputs.meta, 0.125)
    plan = SplitKVPlan(block_m=16, block_n=block_n, num_splits=num_splits, num_warps=4, num_stages=2)
    out = torch.full_like(inputs.q, float("nan"))
    triton_attention.run_tree_attention(*inputs.tensors(), inputs.meta, 0.125, plan, out)
    assert relative_error(out, ref) < 1e-2


HOPPER_SHARED_MEMORY = 232448  # bytes per block on an H100/H200


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("max_q_len", [1, 16, 64, 256, 2048])
def test_every_plan_fits_hoppers_shared_memory(head_dim: int, element_size: int, max_q_len: int) -> None:
    """The q tile plus two pipelined key and value tiles of a plan fit one block's shared memory (fp32, as the
    exactness replays run the target, once asked for a 256-row tile that needed 257 KB)."""
    triton_attention = pytest.importorskip("diffspec_kernels.tree_attention_triton")
    plan = triton_attention.plan_tree_attention(1, 8, 4, max_q_len, 65536, head_dim, 132, element_size)
    tile_bytes = (plan.block_m + plan.num_stages * 2 * plan.block_n) * head_dim * element_size
    assert tile_bytes <= HOPPER_SHARED_MEMORY


# -- Input checks ---------------------------------------------------------------------------------------

CHECKED_CASE = Case((3, 2), (20, 5), num_heads=4, num_kv_heads=2, head_dim=16, page_size=8)
BAD_INPUTS = [
    ("q", lambda q: q.double(), TypeError),
    ("v_new", lambda v: v.half(), TypeError),
    ("k_pages", lambda k: k.transpose(1, 2).contiguous().transpose(1, 2), ValueError),  # not contiguous
    ("v_new", lambda v: v.to("meta"), ValueError),
    ("q", lambda q: q.flatten(1), ValueError),
    ("k_new", lambda k: k[:, :, :8].contiguous(), ValueError),  # head_dim differs from q's
    ("k_pages", lambda k: k[:, :4].contiguous(), ValueError),  # not meta.page_size tokens a page
    ("q", lambda q: q[:, :3].contiguous(), ValueError),  # 3 heads over 2 kv heads
    ("meta.block_tables", lambda t: t.long(), TypeError),
    ("meta.cu_q_lens", lambda t: t.repeat_interleave(2)[::2], ValueError),  # not contiguous
    ("meta.context_lens_t", lambda t: t.to("meta"), ValueError),
    ("meta.new_token_mask", lambda m: m.to(torch.uint8), TypeError),
    ("meta.q_lens", lambda q_lens: [3, 3], ValueError),
]


@pytest.mark.parametrize("name, corrupt, error", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_inputs_fail_before_the_kernel(name: str, corrupt, error: type[Exception]) -> None:
    triton_attention = pytest.importorskip("diffspec_kernels.tree_attention_triton")
    inputs = make_inputs(CHECKED_CASE, "cpu", seed=0)
    args = dict(zip(("q", "k_new", "v_new", "k_pages", "v_pages"), inputs.tensors()), meta=inputs.meta, scale=0.25)
    if name.startswith("meta."):
        field = name.removeprefix("meta.")
        args["meta"] = dataclasses.replace(inputs.meta, **{field: corrupt(getattr(inputs.meta, field))})
    else:
        args[name] = corrupt(args[name])
    with pytest.raises(error):
        triton_attention.tree_attention_triton(**args)


@pytest.mark.parametrize("head_dim, page_size", [(24, 8), (8, 8), (16, 12)])
def test_head_dim_and_page_size_must_be_powers_of_two(head_dim: int, page_size: int) -> None:
    triton_attention = pytest.importorskip("diffspec_kernels.tree_attention_triton")
    case = dataclasses.replace(CHECKED_CASE, head_dim=head_dim, page_size=page_size)
    inputs = make_inputs(case, "cpu", seed=0)
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.tree_attention_triton(*inputs.tensors(), inputs.meta, scale=0.25)

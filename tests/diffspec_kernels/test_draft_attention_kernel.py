"""Draft attention: the Triton kernel against the PyTorch reference (GPU, and small cases on CPU under the Triton
interpreter), its launch plan, and its input checks. The reference itself is tested against a plain softmax in
tests/draft_service/test_draft_attention.py."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from diffspec_kernels.draft_attention_ref import draft_attention_reference
from diffspec_kernels.split_plan import SplitKVPlan
from tests.diffspec_kernels.kernel_cases import kernel_cases
from tests.diffspec_kernels.test_tree_attention import interpreter_loop_warning, relative_error, skip_if_interpreter_breaks_loops

triton_attention = pytest.importorskip("diffspec_kernels.draft_attention_triton")

B16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
TOLERANCE = {F32: 1e-4, F16: 1e-2, B16: 1e-2}  # relative error against the fp32 reference


@dataclass(frozen=True)
class Case:
    lengths: tuple[int, ...] | None  # [batch] valid context keys per session; None: all `capacity` valid (batch 1)
    capacity: int  # context keys per session, padding included
    num_queries: int  # n
    num_new: int  # m
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = F32

    @property
    def batch(self) -> int:
        return 1 if self.lengths is None else len(self.lengths)

    def __str__(self) -> str:
        lengths = "all" if self.lengths is None else "-".join(map(str, self.lengths))
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"L{lengths}of{self.capacity}_n{self.num_queries}_m{self.num_new}"
            f"_H{self.num_heads}/{self.num_kv_heads}_D{self.head_dim}_{dtype}"
        )


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # [batch, n, heads, hd]
    ctx_k: torch.Tensor  # [batch, capacity, kv_heads, hd], NaN past each length (a kernel must not read there)
    ctx_v: torch.Tensor  # [batch, capacity, kv_heads, hd], NaN past each length
    new_k: torch.Tensor  # [batch, m, kv_heads, hd]
    new_v: torch.Tensor  # [batch, m, kv_heads, hd]
    new_mask: torch.Tensor  # [batch, n, m] bool, every query sees at least one entry when m > 0
    ctx_lengths: torch.Tensor | None  # [batch] int64

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.ctx_k, self.ctx_v, self.new_k, self.new_v, self.new_mask

    def reference(self, scale: float) -> torch.Tensor:
        """The fp32 reference (padding zeroed: its masked-out keys still multiply their values by 0)."""
        q, ctx_k, ctx_v, new_k, new_v = (t.float().nan_to_num(0.0) for t in self.tensors()[:5])
        return draft_attention_reference(q, ctx_k, ctx_v, new_k, new_v, self.new_mask, scale, self.ctx_lengths)


def make_inputs(case: Case, device: str, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = (case.num_kv_heads, case.head_dim)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(case.dtype)

    ctx_k, ctx_v = randn(case.batch, case.capacity, *kv), randn(case.batch, case.capacity, *kv)
    lengths = None
    if case.lengths is not None:
        lengths = torch.tensor(case.lengths, dtype=torch.int64, device=device)
        padding = torch.arange(case.capacity, device=device) >= lengths[:, None]  # [batch, capacity]
        ctx_k[padding], ctx_v[padding] = float("nan"), float("nan")
    new_mask = torch.rand(case.batch, case.num_queries, case.num_new, generator=gen, device=device) < 0.5
    if case.num_new:
        new_mask[:, torch.arange(case.num_queries), torch.arange(case.num_queries) % case.num_new] = True
    return Inputs(
        q=randn(case.batch, case.num_queries, case.num_heads, case.head_dim),
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        new_k=randn(case.batch, case.num_new, *kv),
        new_v=randn(case.batch, case.num_new, *kv),
        new_mask=new_mask,
        ctx_lengths=lengths,
    )


@pytest.fixture
def exact_bf16_dot(monkeypatch: pytest.MonkeyPatch, kernel_device: str) -> None:
    """Triton 3.6's interpreter multiplies bf16 ``tl.dot`` operands as their raw 16-bit patterns; widen them to
    fp32 first (exact: a bf16 is the top half of an fp32), so bf16 cases run interpreted too."""
    if kernel_device != "cpu":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    def widened(operand: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if operand.dtype.scalar != tl.bfloat16:
            return operand
        data = interpreter._convert_float(operand.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(
        interpreter.InterpreterBuilder,
        "create_dot",
        lambda builder, a, b, d, *args: create_dot(builder, widened(a), widened(b), d, *args),
    )


# -- The kernel against the reference: the 8B head's shapes on a GPU, small cases interpreted on CPU ------------

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=B16)


def gpu_case(batch: int, num_queries: int, capacity: int) -> Case:
    """Lengths spread over the upper half of the capacity (the capacity bucket of the longest), the first full."""
    lengths = tuple(capacity - (b * 7919) % (capacity // 2) for b in range(batch))
    return Case(lengths, capacity, num_queries, num_new=64, **LLAMA_8B)


TRITON_CASES = kernel_cases(
    gpu=[
        *[gpu_case(b, n, ctx) for b in (1, 16) for n in (1, 10, 64) for ctx in (2048, 65536)],
        Case((5000, 0, 17, 4096), 4096, 24, num_new=256, **LLAMA_8B),
        Case(None, 1000, 1, num_new=0, num_heads=32, num_kv_heads=8, head_dim=128, dtype=F16),
        Case((3000, 1), 3072, 64, num_new=200, num_heads=32, num_kv_heads=8, head_dim=128, dtype=F32),
        Case((700, 90), 1024, 8, num_new=30, num_heads=6, num_kv_heads=2, head_dim=64, dtype=B16),
    ],
    interpreted=[
        Case((150, 37, 0), 160, 5, num_new=7, num_heads=8, num_kv_heads=2, head_dim=16),  # lengths differ, one is 0
        Case((40, 13), 48, 3, num_new=0, num_heads=2, num_kv_heads=2, head_dim=32),  # no new entries
        Case((100, 1), 130, 4, num_new=6, num_heads=8, num_kv_heads=2, head_dim=16, dtype=B16),
        Case(None, 70, 1, num_new=3, num_heads=4, num_kv_heads=1, head_dim=16, dtype=F16),
        Case((0,), 20, 2, num_new=1, num_heads=2, num_kv_heads=1, head_dim=16),  # only the new entries
    ],
)


@interpreter_loop_warning
@pytest.mark.usefixtures("exact_bf16_dot")
@pytest.mark.parametrize("case", TRITON_CASES, ids=str)
def test_triton_matches_reference(kernel_device: str, case: Case) -> None:
    skip_if_interpreter_breaks_loops(kernel_device)
    inputs = make_inputs(case, kernel_device, seed=zlib.crc32(str(case).encode()))
    scale = case.head_dim**-0.5
    ref = inputs.reference(scale)
    plan = triton_attention.default_plan(inputs.q, inputs.ctx_k, inputs.new_k)
    outs = []
    for _ in range(2):  # twice into NaN-poisoned buffers: every element written, bitwise the same both times
        out = torch.full_like(inputs.q, float("nan"))
        triton_attention.run_draft_attention(*inputs.tensors(), scale, inputs.ctx_lengths, plan, out)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[0], ref) < TOLERANCE[case.dtype]
    assert torch.equal(triton_attention.draft_attention_triton(*inputs.tensors(), scale, inputs.ctx_lengths), outs[0])


SPLIT_CASE = Case((70, 9, 0, 33), 80, 3, num_new=5, num_heads=4, num_kv_heads=2, head_dim=16, dtype=F16)
SPLIT_CASES = kernel_cases(
    gpu=[(SPLIT_CASE, block_n, splits) for block_n, splits in [(16, 1), (16, 5), (64, 3), (16, 64)]],
    interpreted=[(SPLIT_CASE, 16, splits) for splits in (1, 3, 16)],
)


@interpreter_loop_warning
@pytest.mark.parametrize("case, block_n, num_splits", SPLIT_CASES)
def test_any_split_count_matches_reference(kernel_device: str, case: Case, block_n: int, num_splits: int) -> None:
    """The split count changes only the order of summation: one split, splits with a partial tile, and splits
    past a session's length (most of them at the largest count, and all of a 0-length session's) all work."""
    skip_if_interpreter_breaks_loops(kernel_device)
    inputs = make_inputs(case, kernel_device, seed=num_splits)
    plan = SplitKVPlan(block_m=16, block_n=block_n, num_splits=num_splits, num_warps=4, num_stages=2)
    out = torch.full_like(inputs.q, float("nan"))
    triton_attention.run_draft_attention(*inputs.tensors(), 0.25, inputs.ctx_lengths, plan, out)
    assert relative_error(out, inputs.reference(0.25)) < TOLERANCE[case.dtype]


@interpreter_loop_warning
@pytest.mark.parametrize("lead", [(), (2, 3), (0,)], ids=str)
def test_leading_dims_flatten_to_one_batch(kernel_device: str, lead: tuple[int, ...]) -> None:
    """No leading dim (one session, as the drafter calls it), several, and an empty batch."""
    skip_if_interpreter_breaks_loops(kernel_device)
    gen = torch.Generator(device=kernel_device).manual_seed(len(lead))
    n, m, capacity, heads, kv_heads, hd = 2, 3, 24, 4, 2, 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*lead, *shape, generator=gen, device=kernel_device)

    q, ctx_k, ctx_v = randn(n, heads, hd), randn(capacity, kv_heads, hd), randn(capacity, kv_heads, hd)
    new_k, new_v = randn(m, kv_heads, hd), randn(m, kv_heads, hd)
    new_mask = torch.ones(*lead, n, m, dtype=torch.bool, device=kernel_device)
    lengths = torch.randint(0, capacity + 1, lead, generator=gen, device=kernel_device)
    args = (q, ctx_k, ctx_v, new_k, new_v, new_mask, 0.3, lengths)
    out = triton_attention.draft_attention_triton(*args)
    assert out.shape == q.shape
    torch.testing.assert_close(out, draft_attention_reference(*args), rtol=1e-4, atol=1e-5)


@interpreter_loop_warning
def test_strided_mask_and_lengths_are_read_in_place(kernel_device: str) -> None:
    """The proposal's mask is a slice of its tree's [B, E, E] mask and its lengths a column of its facts."""
    skip_if_interpreter_breaks_loops(kernel_device)
    inputs = make_inputs(Case((30, 5), 32, 3, 6, 2, 1, 16), kernel_device, seed=3)
    sees = torch.zeros(2, 6, 6, dtype=torch.bool, device=kernel_device)
    sees[:, 3:] = inputs.new_mask
    facts = torch.zeros(2, 4, dtype=torch.int64, device=kernel_device)
    facts[:, 2] = inputs.ctx_lengths
    args = (*inputs.tensors()[:5], sees[:, 3:], 0.5, facts[:, 2])
    assert not args[5].is_contiguous()
    out = triton_attention.draft_attention_triton(*args)
    assert relative_error(out, inputs.reference(0.5)) < 1e-4


# -- The launch plan (pinned shape by shape in tests/diffspec_kernels/test_split_plan.py) ------------------------------


def test_plan_fits_hopper_shared_memory():
    """The q tile and two stages of key and value tiles, for every dtype and head_dim, within 227 KB."""
    for element_size in (2, 4):
        for head_dim in (16, 64, 128, 256):
            for n in (1, 10, 64):
                plan = triton_attention.plan_draft_attention(1, 8, 4, n, 65536, 64, head_dim, element_size, 132)
                row_bytes = head_dim * element_size
                shared = plan.block_m * row_bytes + plan.num_stages * 2 * plan.block_n * row_bytes
                assert shared <= 227 * 1024, (element_size, head_dim, n, plan)


# -- Input checks -------------------------------------------------------------------------------------------


def _good_args() -> dict:
    q = torch.zeros(2, 3, 4, 16)
    ctx, new = torch.zeros(2, 10, 2, 16), torch.zeros(2, 5, 2, 16)
    return dict(
        q=q, ctx_k=ctx, ctx_v=ctx, new_k=new, new_v=new, new_mask=torch.ones(2, 3, 5, dtype=torch.bool),
        scale=1.0, ctx_lengths=torch.tensor([10, 3]),
    )  # fmt: skip


BAD_INPUTS = [
    ("q", torch.zeros(2, 3, 4, 16, dtype=torch.float64), TypeError),
    ("ctx_v", torch.zeros(2, 10, 2, 16, dtype=torch.float16), TypeError),
    ("q", torch.zeros(2, 4, 3, 16).transpose(1, 2), ValueError),  # not contiguous
    ("q", torch.zeros(16), ValueError),
    ("ctx_v", torch.zeros(2, 11, 2, 16), ValueError),
    ("new_k", torch.zeros(2, 5, 1, 16), ValueError),
    ("new_mask", torch.ones(2, 3, 4, dtype=torch.bool), ValueError),
    ("new_mask", torch.ones(2, 5, 3, dtype=torch.bool).transpose(1, 2), ValueError),  # last dim strided
    ("new_mask", torch.ones(2, 3, 5, dtype=torch.uint8), TypeError),
    ("new_mask", torch.ones(2, 3, 5, dtype=torch.bool, device="meta"), ValueError),
    ("ctx_lengths", torch.tensor([10, 3], dtype=torch.int32), TypeError),
    ("ctx_lengths", torch.tensor([10, 3], device="meta"), ValueError),
    ("ctx_lengths", torch.tensor([10]), ValueError),
    ("ctx_k", torch.zeros(2, 10, 2, 16, device="meta"), ValueError),
    ("new_v", torch.zeros(2, 2, 5, 16).transpose(1, 2), ValueError),  # not contiguous
    ("ctx_k", torch.zeros(20, 2, 16), ValueError),  # no batch dim
    ("q", torch.zeros(2, 3, 3, 16), ValueError),  # 3 heads over 2 kv heads
    ("q", torch.zeros(2, 0, 4, 16), ValueError),  # no query
]


@pytest.mark.parametrize("name, value, error", BAD_INPUTS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_inputs_fail_before_the_kernel(name: str, value: torch.Tensor, error: type[Exception]) -> None:
    with pytest.raises(error):
        triton_attention.draft_attention_triton(**{**_good_args(), name: value})


def test_head_dim_must_be_a_power_of_two():
    args = _good_args()
    q, ctx, new = torch.zeros(2, 3, 4, 24), torch.zeros(2, 10, 2, 24), torch.zeros(2, 5, 2, 24)
    with pytest.raises(ValueError, match="power of two"):
        triton_attention.draft_attention_triton(**{**args, "q": q, "ctx_k": ctx, "ctx_v": ctx, "new_k": new, "new_v": new})

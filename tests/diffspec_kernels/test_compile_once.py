"""Kernels whose sizes change from call to call compile once for them (GPU). Triton specialises an integer
argument on being 1 and on being a multiple of 16; for a size that moves with the prompt or the context,
each new combination met would compile again, inside a request (hundreds of milliseconds each)."""

from __future__ import annotations

import pytest
import torch

from tests.diffspec_kernels.test_tree_attention import Case, make_inputs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA/ROCm GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _compiles(kernel, calls) -> int:  # noqa: ANN001 - a triton JITFunction
    """Distinct compiles of ``kernel`` that ``calls`` (run in turn) need, counted from an empty cache."""
    kernel.device_caches.clear()
    for call in calls:
        call()
    torch.cuda.synchronize()
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_tree_attention_compiles_once_across_lengths_tables_and_splits():
    from diffspec_kernels import tree_attention_triton as module

    # 1-4 tokens x 4 heads per kv head keep one tile shape; the contexts give 1, 16 and 17 pages a
    # sequence (1, 16, 17 splits' worth of keys at 4096 and 4112) and the new tokens 1 and 3 columns
    cases = [Case((q,), (ctx,), 8, 2, 64, 16, torch.bfloat16) for q in (1, 3) for ctx in (16, 256, 272, 4096, 4112)]
    inputs = [make_inputs(case, "cuda", seed) for seed, case in enumerate(cases)]
    calls = [lambda i=i: module.tree_attention_triton(*i.tensors(), i.meta, 0.125) for i in inputs]
    assert _compiles(module._tree_attention_partials_kernel, calls) == 1


def test_kv_commit_compiles_once_across_step_sizes():
    from diffspec_kernels import kv_commit_triton as module

    pages = torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)

    def commit(n: int) -> None:
        new = torch.randn(2, n, 2, 64, device=DEVICE).to(torch.bfloat16)
        index = torch.arange(n, device=DEVICE)
        module.kv_commit_triton(pages, pages.clone(), new, new.clone(), index, index)

    assert _compiles(module._kv_commit_kernel, [lambda n=n: commit(n) for n in (1, 5, 16, 17, 32)]) == 1


def test_chunk_scoring_compiles_once_as_contexts_grow():
    from diffspec_kernels import chunk_scoring_triton as module

    pages = torch.randn(80, 64, 2, 64, device=DEVICE).to(torch.bfloat16)  # a pool of 80 pages of 64 chunks

    def score(batch: int, max_pages: int) -> None:
        q = torch.randn(batch, 8, 64, device=DEVICE).to(torch.bfloat16)
        ids = torch.randint(0, 80, (batch * max_pages + batch,), device=DEVICE)  # one upload, as the pool's
        table, num_chunks = ids.split([batch * max_pages, batch])
        module.chunk_scores_triton(q, pages, pages + 1, table.view(batch, max_pages), num_chunks)

    # (sessions, widest page table): the chunk counts at 16-byte offsets into the upload and not
    shapes = [(1, 1), (16, 1), (3, 16), (17, 17), (1, 65)]
    assert _compiles(module._chunk_scores_kernel, [lambda s=s: score(*s) for s in shapes]) == 1


def test_qkv_rope_compiles_once_across_row_counts():
    from diffspec_kernels import layer_ops_triton as module

    heads, kv_heads, dim = 4, 2, 64

    def rope(rows: int) -> None:
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device=DEVICE).to(torch.bfloat16)
        cos = torch.randn(rows, dim, device=DEVICE).to(torch.bfloat16)
        module.qkv_rope_triton(qkv, cos, cos.clone(), heads, kv_heads)

    assert _compiles(module._qkv_rope_kernel, [lambda n=n: rope(n) for n in (1, 3, 16, 17)]) == 1


def test_int8_linear_compiles_once_for_every_row_count_of_a_tile():
    """A draft depth's and an accept's rows (1 to 16 share one 16-row tile) compile once; the tile's plan is
    what changes with more rows, not the row count."""
    from diffspec_kernels import int8_linear_triton as module
    from diffspec_kernels.int8_linear_ref import quantize_int8

    q, scale = quantize_int8(torch.randn(96, 256))
    q, scale = q.to(DEVICE), scale.to(DEVICE)

    def multiply(rows: int) -> None:
        module.int8_linear_triton(torch.randn(rows, 256, device=DEVICE).to(torch.bfloat16), q, scale)

    assert _compiles(module._int8_linear_kernel, [lambda n=n: multiply(n) for n in (1, 5, 10, 16)]) == 1

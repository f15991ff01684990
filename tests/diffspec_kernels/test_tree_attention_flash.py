"""flash-attn tree attention against the reference: a PyTorch stand-in for flash-attn on CPU, the real one on GPU."""

from __future__ import annotations

import importlib.util
import zlib

import pytest
import torch

import diffspec_kernels.tree_attention_flash as flash
from diffspec.errors import InvalidRequest
from diffspec_kernels.attention_metadata import AttentionMetadata, causal_mask
from diffspec_kernels.tree_attention_ref import tree_attention_reference
from target_service.attention_backends import attention_backend
from tests.diffspec_kernels.test_tree_attention import Case, Inputs, make_inputs, relative_error

B16, F16 = torch.bfloat16, torch.float16


def fake_flash_attn_with_kvcache(
    q: torch.Tensor,  # [batch, T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    *,
    cache_seqlens: torch.Tensor,  # [batch] int32
    block_table: torch.Tensor,  # [batch, max_pages_per_seq] int32
    softmax_scale: float,
    causal: bool,
    return_softmax_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [batch, T, num_heads, head_dim] in q's dtype, lse [batch, num_heads, T]
    """flash-attn 2's documented contract for the arguments the backend passes, including lse +inf with no keys."""
    assert not causal and return_softmax_lse
    group = q.shape[2] // k_cache.shape[2]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # [batch, pages * page_size, num_heads, head_dim] fp32
        return cache[block_table.long()].flatten(1, 2).repeat_interleave(group, dim=2).float()

    keys, values = gather(k_cache), gather(v_cache)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * softmax_scale
    past_end = torch.arange(keys.shape[1], device=q.device) >= cache_seqlens[:, None]  # [batch, keys]
    scores = scores.masked_fill(past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no keys: output 0
    lse = scores.logsumexp(dim=-1).masked_fill((cache_seqlens == 0)[:, None, None], float("inf"))
    return torch.einsum("bhqk,bkhd->bqhd", probs, values).to(q.dtype), lse


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flash, "_flash_kvcache", lambda: fake_flash_attn_with_kvcache)


def with_causal_masks(inputs: Inputs) -> AttentionMetadata:
    """The same batch as prefill chunks: causal masks instead of random trees."""
    meta = inputs.meta
    q_lens, context_lens = meta.q_lens, meta.context_lens_t.tolist()
    masks = [causal_mask(n) for n in q_lens]
    return AttentionMetadata.build(q_lens, context_lens, inputs.block_tables, masks, meta.page_size, inputs.q.device)


def assert_matches_reference(inputs: Inputs, meta: AttentionMetadata, max_error: float) -> None:
    scale = inputs.q.shape[2] ** -0.5
    out = flash.tree_attention_flash(*inputs.tensors(), meta, scale)
    ref = tree_attention_reference(*(t.float() for t in inputs.tensors()), meta, scale)
    assert out.dtype == inputs.q.dtype and out.shape == inputs.q.shape
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max() < max_error * ref.abs().max()
    assert relative_error(out, ref) < max_error


# -- CPU: the merge and padding around a PyTorch stand-in for flash-attn ---------------------------------

CPU_CASES = [
    Case((1, 5, 17), (300, 0, 700), num_heads=4, num_kv_heads=4, head_dim=64, page_size=256, dtype=B16),
    Case((17, 1, 5, 1), (1, 700, 300, 0), num_heads=8, num_kv_heads=2, head_dim=64, page_size=256, dtype=B16),
    Case((5,), (0,), num_heads=8, num_kv_heads=2, head_dim=64, page_size=256, dtype=B16),
    Case((17,), (700,), num_heads=4, num_kv_heads=1, head_dim=64, page_size=256, dtype=F16),
]


@pytest.mark.parametrize("masks", ["tree", "causal"])
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_flash_matches_reference_cpu(case: Case, masks: str, fake_flash: None) -> None:
    inputs = make_inputs(case, "cpu", seed=zlib.crc32(str(case).encode()))
    meta = inputs.meta if masks == "tree" else with_causal_masks(inputs)
    assert_matches_reference(inputs, meta, max_error=1e-2)


def test_flash_root_without_context_returns_its_value(fake_flash: None) -> None:
    """A root with no context sees only itself (weight 1), however flash-attn scores the empty prefix."""
    case = Case((1, 5), (0, 300), num_heads=8, num_kv_heads=2, head_dim=64, page_size=256, dtype=B16)
    inputs = make_inputs(case, "cpu", seed=0)
    out = flash.tree_attention_flash(*inputs.tensors(), inputs.meta, scale=0.125)
    assert not out.isnan().any()
    assert torch.equal(out[0], inputs.v_new[0].repeat_interleave(4, dim=0))


def test_flash_rejects_pages_flash_attn_cannot_read(fake_flash: None) -> None:
    inputs = make_inputs(Case((5,), (300,), 4, 4, 64, page_size=16, dtype=B16), "cpu", seed=0)
    with pytest.raises(ValueError, match="multiple of 256 or use the triton backend"):
        flash.tree_attention_flash(*inputs.tensors(), inputs.meta, scale=0.125)


def test_flash_rejects_float32(fake_flash: None) -> None:
    inputs = make_inputs(Case((5,), (300,), 4, 4, 64, page_size=256, dtype=torch.float32), "cpu", seed=0)
    with pytest.raises(TypeError, match="must share one of"):
        flash.tree_attention_flash(*inputs.tensors(), inputs.meta, scale=0.125)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_backend_unavailable_without_flash_attn() -> None:
    with pytest.raises(InvalidRequest, match="not available here"):
        attention_backend("flash-attn")


# -- GPU: the real flash-attn ----------------------------------------------------------------------------

GPU_CASES = [
    Case((1, 17, 64), (4096, 0, 1000), num_heads=32, num_kv_heads=8, head_dim=128, page_size=256, dtype=B16),
    Case((1, 1), (65536, 4096), num_heads=32, num_kv_heads=8, head_dim=128, page_size=256, dtype=B16),
    Case((64,), (65536,), num_heads=32, num_kv_heads=8, head_dim=128, page_size=512, dtype=B16),
    Case((5, 32), (4096, 1), num_heads=16, num_kv_heads=16, head_dim=64, page_size=256, dtype=F16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("masks", ["tree", "causal"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_flash_matches_reference_gpu(case: Case, masks: str) -> None:
    pytest.importorskip("flash_attn")
    inputs = make_inputs(case, "cuda", seed=zlib.crc32(str(case).encode()))
    meta = inputs.meta if masks == "tree" else with_causal_masks(inputs)
    assert_matches_reference(inputs, meta, max_error=1e-2)

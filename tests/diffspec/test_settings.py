"""Settings that name step-graph buckets and the attention backend are checked where they are read; the draft's
prefix cache follows the pool unless sized."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from diffspec.settings import DiffSpecSettings, parse_sizes
from target_service.attention_backends import resolve_backend_name


def test_bucket_sizes_parse_sorted_and_distinct():
    assert parse_sizes("16, 1,4,4") == (1, 4, 16)


@pytest.mark.parametrize("bad", ["", "1,,2", "0,4", "a", "-1", "2.5"])
def test_bad_bucket_sizes_are_refused(bad):
    with pytest.raises(ValidationError, match="comma-separated positive integers"):
        DiffSpecSettings(graph_tree_sizes=bad)
    with pytest.raises(ValidationError, match="comma-separated positive integers"):
        DiffSpecSettings(graph_batch_sizes=bad)


def test_auto_backend_is_triton_on_a_gpu_and_torch_on_cpu():
    assert resolve_backend_name("auto", torch.device("cuda")) == "triton"
    assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
    assert resolve_backend_name("flash-attn", torch.device("cuda")) == "flash-attn"


@pytest.mark.parametrize(
    ("tokens", "num_pages", "page_size", "capacity"),
    [(-1, 4096, 16, 65536), (-1, 16384, 16, 262144), (-1, 100, 32, 3200), (0, 4096, 16, 0), (1024, 4096, 16, 1024)],
)
def test_the_draft_prefix_cache_holds_the_pool_s_tokens_unless_told(tokens, num_pages, page_size, capacity):
    settings = DiffSpecSettings(draft_prefix_cache_tokens=tokens, num_pages=num_pages, page_size=page_size)
    assert settings.draft_prefix_cache_capacity == capacity


def test_a_draft_prefix_cache_size_under_minus_one_is_refused():
    with pytest.raises(ValidationError, match="greater than or equal to -1"):
        DiffSpecSettings(draft_prefix_cache_tokens=-2)

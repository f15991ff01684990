"""Settings that name step-graph buckets and the attention backend are checked where they are read."""

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

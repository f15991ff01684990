"""The project's own Llama forward against transformers' LlamaForCausalLM (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from target_service.llama import LlamaModel
from tests.conftest import write_random_llama

CPU = torch.device("cpu")


def _hf_logits_and_states(model_dir, ids: torch.Tensor):
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return out.logits, out.hidden_states


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"llama3_rope": True},
        {"tie_embeddings": False},
        {"llama3_rope": True, "tie_embeddings": False, "num_kv_heads": 8, "max_shard_size": "60KB"},
        {"num_kv_heads": 1},
    ],
    ids=["gqa", "llama3-rope", "untied", "llama3-untied-mha-sharded", "mqa"],
)
def test_random_configs_match_transformers(tmp_path, variant):
    model_dir = write_random_llama(tmp_path, **variant)
    ids = torch.randint(3, 320, (2, 150), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_states = _hf_logits_and_states(model_dir, ids)
    model = LlamaModel.from_pretrained(model_dir, CPU, torch.float32)
    hidden, features = model.forward_dense(ids, (1, 2, 3))
    assert (model.logits(hidden) - ref_logits).abs().max() <= 1e-4
    expected = torch.cat([ref_states[1], ref_states[2], ref_states[3]], dim=-1)
    assert (features - expected).abs().max() <= 1e-4


def test_bundled_model_matches_transformers(tiny_target_dir):
    ids = torch.randint(3, 8192, (1, 300), generator=torch.Generator().manual_seed(2))
    ref_logits, ref_states = _hf_logits_and_states(tiny_target_dir, ids)
    model = LlamaModel.from_pretrained(tiny_target_dir, CPU, torch.float32)
    hidden, features = model.forward_dense(ids, (1, 2, 3))
    assert (model.logits(hidden) - ref_logits).abs().max() <= 1e-4
    assert (features[..., 256:512] - ref_states[2]).abs().max() <= 1e-4

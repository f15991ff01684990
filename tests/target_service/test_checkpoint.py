"""Checkpoint directories as users have them, and the errors for ones that are not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from diffspec.errors import CheckpointError
from target_service.checkpoint import load_llama_config, parse_llama_config, safetensors_files
from target_service.llama import LlamaModel
from tests.conftest import write_random_llama

LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def test_llama31_8b_config_parses():
    config = parse_llama_config(LLAMA31_8B_CONFIG)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (32, 32, 8, 128)
    assert config.rope.kind == "llama3" and config.rope.factor == 8.0 and config.rope.theta == 500000.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert not config.tie_word_embeddings


def test_sharded_checkpoint_lists_every_shard(tmp_path):
    write_random_llama(tmp_path, max_shard_size="60KB", tie_embeddings=False)
    files = safetensors_files(tmp_path)
    assert len(files) > 1 and all(f.suffix == ".safetensors" for f in files)
    model = LlamaModel.from_pretrained(tmp_path, torch.device("cpu"), torch.bfloat16)
    assert model.lm_head is not model.embed_tokens and model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda d: shutil.rmtree(d), "does not exist"),
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda d: [f.unlink() for f in d.glob("*.safetensors")], "no safetensors weights"),
        (lambda d: _edit_config(d, hidden_size=None), "lacks 'hidden_size'"),
        (lambda d: _edit_config(d, intermediate_size=100), "has shape"),
        (lambda d: _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral"), "unsupported architecture"),
        (lambda d: _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope scaling"),
    ],
    ids=["no-dir", "no-config", "bad-json", "no-weights", "missing-key", "wrong-shape", "not-llama", "bad-rope"],
)
def test_broken_checkpoints_fail_clearly(tmp_path, breakage, message):
    model_dir = write_random_llama(tmp_path / "m")
    breakage(model_dir)
    with pytest.raises(CheckpointError, match=message):
        LlamaModel.from_pretrained(model_dir, torch.device("cpu"), torch.float32)


def test_missing_shard_is_named(tmp_path):
    write_random_llama(tmp_path, max_shard_size="60KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        safetensors_files(tmp_path)


def _edit_config(model_dir, **changes) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    if "rope_scaling" in changes:  # transformers 5 writes rope_parameters, which would win
        raw.pop("rope_parameters", None)
    (model_dir / "config.json").write_text(json.dumps(raw))


def test_config_of_bundled_model(tiny_target_dir):
    config = load_llama_config(tiny_target_dir)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (4, 256, 8192)
    assert config.rope.theta == 1_000_000.0 and config.tie_word_embeddings

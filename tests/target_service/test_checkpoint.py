"""Checkpoint directories as users have them, and the errors for ones that are not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from diffspec.checkpoint import load_tensor, load_weights, safetensors_files
from diffspec.errors import CheckpointError
from diffspec.model_config import GenerationConfig, load_generation_config, load_llama_config, parse_llama_config
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


# Llama-3-8B-Instruct names <|eot_id|> (128009) in generation_config.json only; Llama-3.1 in both.
LLAMA3_GENERATION_CONFIG = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
                            "max_length": 4096, "temperature": 0.6, "top_p": 0.9}


def test_generation_config_eos_ids_join_the_configs(tmp_path):
    write_random_llama(tmp_path, llama3_rope=True, tie_embeddings=False, max_shard_size="60KB")
    _edit_config(tmp_path, eos_token_id=1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1, 3], "bos_token_id": 0}))
    config = load_llama_config(tmp_path)
    assert config.eos_token_ids == (1, 2, 3) and config.bos_token_id == 0
    model = LlamaModel.from_pretrained(tmp_path, torch.device("cpu"), torch.float32)
    assert model.config.eos_token_ids == (1, 2, 3)
    (tmp_path / "generation_config.json").unlink()
    assert load_llama_config(tmp_path).eos_token_ids == (1,)
    assert load_generation_config(tmp_path) == GenerationConfig()


def test_generation_config_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(LLAMA3_GENERATION_CONFIG))
    assert load_generation_config(tmp_path) == GenerationConfig(
        eos_token_ids=(128001, 128009), bos_token_id=128000, temperature=0.6, top_p=0.9
    )
    greedy = LLAMA3_GENERATION_CONFIG | {"do_sample": False, "top_k": 50}
    (tmp_path / "generation_config.json").write_text(json.dumps(greedy))
    assert load_generation_config(tmp_path).temperature is None  # transformers ignores them without do_sample
    (tmp_path / "generation_config.json").write_text(json.dumps(greedy | {"eos_token_id": "end"}))
    with pytest.raises(CheckpointError, match="generation_config.json has a malformed value"):
        load_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        load_generation_config(tmp_path)


def test_one_tensor_is_read_from_its_shard(tmp_path):
    write_random_llama(tmp_path, tie_embeddings=False, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    everything = load_weights(tmp_path)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.mlp.down_proj.weight"):
        tensor = load_tensor(tmp_path, name, torch.device("cpu"), torch.float32)
        assert tensor.dtype == torch.float32 and torch.equal(tensor, everything[name].float())
    others = sorted(set(index.values()) - {index["lm_head.weight"]})
    for shard in others:  # only the shard named by the index is opened
        (tmp_path / shard).write_bytes(b"not safetensors")
    assert load_tensor(tmp_path, "lm_head.weight", torch.device("cpu"), None).shape == (320, 64)
    with pytest.raises(CheckpointError, match="holds no model.absent"):
        load_tensor(tmp_path, "model.absent", torch.device("cpu"), None)
    with pytest.raises(CheckpointError, match=f"cannot read .*{others[0]}"):
        load_tensor(tmp_path, next(k for k, v in index.items() if v == others[0]), torch.device("cpu"), None)


def test_pytorch_model_bin_is_read_without_running_code(tmp_path):
    state = {"a.weight": torch.arange(6.0).reshape(2, 3), "d2t": torch.zeros(4, dtype=torch.int64)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = load_weights(tmp_path)
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    torch.save({"a": [1, 2]}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a flat state dict of tensors"):
        load_weights(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_weights(tmp_path)

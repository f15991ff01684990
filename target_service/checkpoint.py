"""Read a Llama-family Hugging Face checkpoint directory: config.json plus single or sharded safetensors.

Only the facts the project's own forward needs are kept (``LlamaConfig``); unsupported layouts
fail here with a ``CheckpointError`` that names the file and the problem, not later in a matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from diffspec.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


def _rope_config(raw: dict) -> RopeConfig:
    # transformers 5 writes "rope_parameters"; Llama-3.1 checkpoints carry "rope_scaling" + "rope_theta".
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if v is not None})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "llama3":
        raise CheckpointError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
    try:
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise CheckpointError(f"llama3 rope scaling lacks {missing}") from None


def parse_llama_config(raw: dict) -> LlamaConfig:
    """Validate a config.json dict and keep what the forward needs."""
    archs = set(raw.get("architectures") or ["LlamaForCausalLM"])
    if not archs & SUPPORTED_ARCHITECTURES and raw.get("model_type") != "llama":
        raise CheckpointError(f"unsupported architecture {sorted(archs)}; expected a Llama-family causal LM")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eos = raw.get("eos_token_id")
        return LlamaConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_positions=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope=_rope_config(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json has a malformed value: {bad}") from None


def read_config(model_dir: Path) -> dict:
    """config.json of a model directory as a dict, with a clear error when absent or not JSON."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as bad:
        raise CheckpointError(f"{path} is not valid JSON: {bad}") from None


def load_llama_config(model_dir: Path) -> LlamaConfig:
    return parse_llama_config(read_config(model_dir))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a checkpoint: the shards named by the index, or the single file."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as bad:
            raise CheckpointError(f"{index} is malformed: {bad}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {model_dir}")
    missing = [f for f in files if not f.exists()]
    if missing:
        raise CheckpointError(f"weight shard(s) missing: {', '.join(str(m) for m in missing)}")
    return files


def load_state_dict(files: list[Path], device: torch.device, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """All tensors of the given safetensors files, cast to ``dtype`` when it is floating point."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[name] = tensor.to(device)
        except (OSError, RuntimeError) as bad:
            raise CheckpointError(f"cannot read {path}: {bad}") from None
    return tensors

"""The facts the project reads from a Hugging Face model directory's JSON files.

``config.json`` -> ``LlamaConfig`` (what the project's own Llama forward needs, EAGLE-3 heads
included: their body is a Llama layer); ``generation_config.json`` -> ``GenerationConfig`` (the
EOS list and sampling defaults the checkpoint ships). Unsupported layouts fail here with a
``CheckpointError`` that names the file and the problem, not later in a matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

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
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # config.json's, then generation_config.json's


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: a field the checkpoint does not set is None (the request's or our default)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    temperature: float | None = None  # applies only when do_sample is true, as in transformers
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None


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


def token_ids(value: object) -> tuple[int, ...]:
    """An ``eos_token_id`` as configs write it (one id, a list, or null) -> a tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)  # type: ignore[call-overload]


def parse_llama_config(raw: dict) -> LlamaConfig:
    """Validate a config.json dict and keep what the forward needs."""
    archs = set(raw.get("architectures") or ["LlamaForCausalLM"])
    if not archs & SUPPORTED_ARCHITECTURES and raw.get("model_type") != "llama":
        raise CheckpointError(f"unsupported architecture {sorted(archs)}; expected a Llama-family causal LM")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
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
            eos_token_ids=token_ids(raw.get("eos_token_id")),
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"config.json has a malformed value: {bad}") from None


def parse_generation_config(raw: dict) -> GenerationConfig:
    """Validate a generation_config.json dict; sampling defaults count only when ``do_sample`` is true."""
    try:
        sampling = bool(raw.get("do_sample", False))
        top_k = raw.get("top_k") if sampling else None
        return GenerationConfig(
            eos_token_ids=token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            temperature=float(raw["temperature"]) if sampling and raw.get("temperature") is not None else None,
            top_p=float(raw["top_p"]) if sampling and raw.get("top_p") is not None else None,
            top_k=int(top_k) if top_k else None,  # 0 means "off" in transformers
            max_new_tokens=int(raw["max_new_tokens"]) if raw.get("max_new_tokens") is not None else None,
        )
    except (TypeError, ValueError) as bad:
        raise CheckpointError(f"generation_config.json has a malformed value: {bad}") from None


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as bad:
        raise CheckpointError(f"{path} is not valid JSON: {bad}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def read_config(model_dir: Path) -> dict:
    """config.json of a model directory as a dict, with a clear error when absent or not JSON."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    return _read_json(path)


def load_generation_config(model_dir: Path) -> GenerationConfig:
    """generation_config.json when the checkpoint ships one, else no defaults."""
    path = Path(model_dir) / "generation_config.json"
    return parse_generation_config(_read_json(path)) if path.exists() else GenerationConfig()


def load_llama_config(model_dir: Path) -> LlamaConfig:
    """config.json, with generation_config.json's EOS ids added: Llama-3-8B-Instruct names <|eot_id|>
    only there, and a chat turn that ends with it would otherwise run on to the length limit."""
    config = parse_llama_config(read_config(model_dir))
    generation = load_generation_config(model_dir)
    eos = tuple(dict.fromkeys(config.eos_token_ids + generation.eos_token_ids))  # ordered union
    bos = generation.bos_token_id if config.bos_token_id is None else config.bos_token_id
    return replace(config, eos_token_ids=eos, bos_token_id=bos)

"""An EAGLE-3 head directory in the published layout: config.json plus ``pytorch_model.bin`` or
safetensors with the keys ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, and
``layers.{i}.*`` for each decoder layer i >= 1 of a deeper head.

Read as vLLM and SGLang read them: ``layers.0.*`` is ``midlayer.*``; above layer 0 the norm before
attention is ``input_layernorm`` (vLLM, a Llama layer) or ``hidden_norm`` (SGLang's name for it);
a name given twice (``midlayer.*`` and ``layers.0.*``, or both norms of one layer) is refused, as
is ``midlayer.{i}.*``, which neither reads. The vocab maps may be left out when the draft vocab is
the whole vocab; an ``embed_tokens.weight`` shipped with the head is the head's own embedding (it
is then saved with it), otherwise the target's is used. Saving writes ``midlayer.*`` and
``layers.{i}.input_layernorm``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffspec.checkpoint import load_weights
from diffspec.errors import CheckpointError
from diffspec.model_config import read_config
from draft_service.eagle3_config import Eagle3Config

EMBEDDING_KEY = "embed_tokens.weight"
VOCAB_MAP_KEYS = ("d2t", "t2d")
LAYER_PREFIX, LAYER_ALIAS = "midlayer.", "layers.0."
UPPER_HIDDEN_NORM = re.compile(r"^(layers\.[1-9][0-9]*\.)hidden_norm\.")  # SGLang's name above layer 0
MIDLAYER_PER_LAYER = re.compile(r"^midlayer\.[0-9]+\.")


@dataclass(frozen=True)
class HeadCheckpoint:
    config: Eagle3Config
    weights: dict[str, torch.Tensor]  # every stored tensor but the embedding, on the CPU, as stored
    embedding: torch.Tensor | None  # [vocab, hidden] when the head ships its own embed_tokens


def read_head_checkpoint(head_dir: Path) -> HeadCheckpoint:
    head_dir = Path(head_dir)
    config = Eagle3Config.from_json(read_config(head_dir))
    weights = _published_names(head_dir, load_weights(head_dir))
    embedding = weights.pop(EMBEDDING_KEY, None)
    if embedding is not None and tuple(embedding.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(f"{head_dir}: {EMBEDDING_KEY} has shape {tuple(embedding.shape)}, "
                              f"expected ({config.vocab_size}, {config.hidden_size})")  # fmt: skip
    return HeadCheckpoint(config, weights, embedding)


def _published_names(head_dir: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored names -> the module's names; two stored names of one tensor are refused, never one picked."""
    stored_as: dict[str, str] = {}
    for name in weights:
        if MIDLAYER_PER_LAYER.match(name):
            raise CheckpointError(f"{head_dir}: {name}: neither vLLM nor SGLang reads midlayer.{{i}}.* keys; "
                                  "layer 0 is midlayer.* (or layers.0.*), layer i >= 1 is layers.{i}.*")  # fmt: skip
        published = _published_name(name)
        if published in stored_as:
            raise CheckpointError(f"{head_dir}: {stored_as[published]} and {name} are both {published} (layers.0.* "
                                  "is midlayer.*; above layer 0 hidden_norm is input_layernorm)")  # fmt: skip
        stored_as[published] = name
    return {published: weights[name] for published, name in stored_as.items()}


def _published_name(name: str) -> str:
    if name.startswith(LAYER_ALIAS):
        return LAYER_PREFIX + name[len(LAYER_ALIAS) :]
    return UPPER_HIDDEN_NORM.sub(r"\1input_layernorm.", name)


def check_weights(head_dir: Path, checkpoint: HeadCheckpoint, expected: dict[str, torch.Tensor]) -> None:
    """Every expected tensor present with its shape and nothing else; d2t/t2d may be absent for a
    full-vocab head (the identity map)."""
    c, weights = checkpoint.config, checkpoint.weights
    optional = set(VOCAB_MAP_KEYS) if c.draft_vocab_size == c.vocab_size else set()
    missing = sorted(expected.keys() - weights.keys() - optional)
    extra = sorted(weights.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(f"{head_dir}: missing keys {missing}, unexpected keys {extra}")
    misshaped = [
        f"{name} {tuple(weights[name].shape)} (expected {tuple(want.shape)})"
        for name, want in expected.items()
        if name in weights and weights[name].shape != want.shape
    ]
    if misshaped:
        raise CheckpointError(f"{head_dir}: misshaped weights: {', '.join(misshaped)}")


def write_head_checkpoint(head_dir: Path, config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + model.safetensors in the published key layout."""
    head_dir = Path(head_dir)
    head_dir.mkdir(parents=True, exist_ok=True)
    (head_dir / "config.json").write_text(json.dumps(config.to_json(), indent=2) + "\n")
    save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, str(head_dir / "model.safetensors"))

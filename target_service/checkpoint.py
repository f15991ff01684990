"""Checkpoint reading lives in the shared model module (``diffspec.model_config``, ``diffspec.checkpoint``);
these names stay for existing importers."""

from diffspec.checkpoint import load_state_dict, safetensors_files
from diffspec.model_config import LlamaConfig, RopeConfig, load_llama_config, parse_llama_config, read_config

__all__ = [
    "LlamaConfig",
    "RopeConfig",
    "load_llama_config",
    "load_state_dict",
    "parse_llama_config",
    "read_config",
    "safetensors_files",
]

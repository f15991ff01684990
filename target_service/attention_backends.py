"""Pick the tree-attention implementation named by the ``attention_backend`` setting."""

from __future__ import annotations

import importlib

from diffspec.errors import InvalidRequest
from target_service.llama import AttentionBackend

# setting value -> (module, function); every function has the reference's signature
_BACKENDS = {
    "torch": ("kernels.tree_attention_ref", "tree_attention_reference"),
    "triton": ("kernels.tree_attention_triton", "tree_attention_triton"),
    "flash-attn": ("kernels.tree_attention_flash", "tree_attention_flash"),
}


def attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidRequest(f"unknown attention backend {name!r}; expected one of {sorted(_BACKENDS)}")
    module_name, function = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as missing:
        raise InvalidRequest(f"attention backend {name!r} is not available here: {missing}") from None
    return getattr(module, function)

"""Pick the tree-attention implementation named by the ``attention_backend`` setting."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from diffspec.errors import InvalidRequest
from diffspec_kernels.dispatch import triton_kernels_on
from target_service.llama import AttentionBackend

# setting value -> (module, function); every function has the reference's signature
_BACKENDS = {
    "torch": ("diffspec_kernels.tree_attention_ref", "tree_attention_reference"),
    "triton": ("diffspec_kernels.tree_attention_triton", "tree_attention_triton"),
    "flash-attn": ("diffspec_kernels.tree_attention_flash", "tree_attention_flash"),
}
# backends whose module imports its package only when first called, so the check happens here
_LAZY_PACKAGES = {"flash-attn": "flash_attn"}


def attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise InvalidRequest(f"unknown attention backend {name!r}; expected one of {sorted(_BACKENDS)}")
    module_name, function = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as missing:
        raise InvalidRequest(f"attention backend {name!r} is not available here: {missing}") from None
    package = _LAZY_PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise InvalidRequest(f"attention backend {name!r} is not available here: no module named {package!r}")
    return getattr(module, function)


# Backends that read every length from the device, so a CUDA graph can replay them with new inputs.
GRAPH_SAFE_BACKENDS = frozenset({"triton", "flash-attn"})


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto`` is the Triton kernel on a GPU and the PyTorch reference elsewhere."""
    if name != "auto":
        return name
    return "triton" if triton_kernels_on(device) else "torch"

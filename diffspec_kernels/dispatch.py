"""The one rule for which implementation of a kernel runs: Triton on a GPU, the PyTorch reference elsewhere.

Every kernel ships both (``diffspec_kernels/*_triton.py`` beside ``*_ref.py``); callers ask here rather
than deciding on their own, so the rule changes in one place (ROCm devices are ``cuda`` to torch).
"""

from __future__ import annotations

import torch


def triton_kernels_on(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on ``device``."""
    return device.type == "cuda"

"""Where the Triton kernels run in these tests: on the GPU when one is visible, else on CPU tensors under
the Triton interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, so it is set here, before any test
module imports a ``kernels/*_triton.py`` (nothing outside tests/kernels imports one on a CPU-only machine).
"""

from __future__ import annotations

import os

import pytest
import torch

GPU_VISIBLE = torch.cuda.is_available()
if not GPU_VISIBLE:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreted: small kernel case that also runs on CPU under TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """The device the Triton kernels run on: "cuda" on a GPU, "cpu" (interpreted) otherwise."""
    return "cuda" if GPU_VISIBLE else "cpu"

"""Where the Triton kernels run in these tests: on the GPU when one is visible, else on CPU tensors under
the Triton interpreter.

``TRITON_INTERPRET`` is set by tests/conftest.py, which pytest loads before any test module.
"""

from __future__ import annotations

import pytest
import torch

GPU_VISIBLE = torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "interpreted: small kernel case that also runs on CPU under TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """The device the Triton kernels run on: "cuda" on a GPU, "cpu" (interpreted) otherwise."""
    return "cuda" if GPU_VISIBLE else "cpu"

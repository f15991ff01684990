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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, test_rocm_compile.py goes first (.ci/run keeps the collection's order of files): the
    worker that takes it waits on the compiles while the other runs the files after it, rather than the
    compiles being the run's last minutes. Every worker orders its collection so, as xdist requires."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.path.name != "test_rocm_compile.py")  # stable: the rest keep their order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the ahead-of-time compiles of test_rocm_compile.py as soon as the session knows it runs them,
    niced, so they use the CPU that the tests before them leave idle. (A pytest-xdist worker does not know
    yet whether it runs them: there the test's fixture starts them, first thing.)"""
    from tests.diffspec_kernels.test_rocm_compile import COMPILATIONS, Compilations, needs_compilations

    worker = hasattr(session.config, "workerinput")
    if not worker and needs_compilations(session.items) and COMPILATIONS not in session.stash:
        session.stash[COMPILATIONS] = Compilations()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.diffspec_kernels.test_rocm_compile import COMPILATIONS

    if COMPILATIONS in session.stash:
        session.stash[COMPILATIONS].stop()

"""The shared library sits under the services: nothing in diffspec/ imports a service, the gateway or the CLI."""

from __future__ import annotations

import ast

import pytest

from diffspec.settings import REPO_ROOT

LAYERS_ABOVE = ("gateway", "draft_service", "target_service", "cli", "bench")


def imported_packages(path) -> set[str]:  # noqa: ANN001 - a Path
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "diffspec").rglob("*.py")), ids=lambda p: p.name)
def test_the_shared_library_imports_nothing_built_on_it(path):
    assert not imported_packages(path) & set(LAYERS_ABOVE)

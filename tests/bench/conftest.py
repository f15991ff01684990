"""Prompts for the reproduce tests, made from this repository's own source (no ../shared needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffspec.settings import REPO_ROOT

SOURCES = ["target_service/kv_pool.py", "target_service/runtime.py"]  # each well over 2K tokens


@pytest.fixture(scope="session")
def code_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSONL dataset of two code prompts: the first is evaluated, the second tunes."""
    path = tmp_path_factory.mktemp("data") / "repo_code.jsonl"
    path.write_text("".join(json.dumps({"text": (REPO_ROOT / s).read_text()}) + "\n" for s in SOURCES))
    return path

"""Prompts for the reproduce tests, made from this repository's own source (no ../shared needed), and one
smoke run on them that the report and analysis tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.reproduce.cli import main
from diffspec.settings import REPO_ROOT

SOURCES = ["target_service/kv_pool.py", "target_service/runtime.py"]  # each well over 2K tokens


@pytest.fixture(scope="session")
def code_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSONL dataset of two code prompts: the first is evaluated, the second tunes."""
    path = tmp_path_factory.mktemp("data") / "repo_code.jsonl"
    path.write_text("".join(json.dumps({"text": (REPO_ROOT / s).read_text()}) + "\n" for s in SOURCES))
    return path


@pytest.fixture(scope="session")
def smoke_run(code_prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict]:
    """(exit code, output folder, results.json) of the smoke preset: tiny pair, 1K context, 8 / 16 tokens."""
    out_dir = tmp_path_factory.mktemp("results") / "smoke"
    argv = ["--preset", "smoke", "--data-files", str(code_prompts), "--context-targets", "1024",
            "--tune-max-new-tokens", "8", "--eval-max-new-tokens", "16", "--warmup-tokens", "4",
            "--out-dir", str(out_dir)]
    exit_code = main(argv)
    return exit_code, out_dir, json.loads((out_dir / "results.json").read_text())


def stopped_copy(run_dir: Path, to: Path) -> Path:
    """A finished run's folder copied to ``to`` as a run stopped before its results were written."""
    shutil.copytree(run_dir, to)
    (to / "results.json").unlink()
    return to


def forbid(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...], why: str) -> None:
    """Each of ``bench.reproduce.protocol``'s ``names`` fails the test when called, saying ``why``."""

    def fail(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError(why)

    for name in names:
        monkeypatch.setattr(f"bench.reproduce.protocol.{name}", fail)

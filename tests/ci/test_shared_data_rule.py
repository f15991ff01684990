"""The rule for tests that read ../shared (tests/conftest.py): they fail where DIFFSPEC_REQUIRE_SHARED=1,
and elsewhere skip with a warning naming each of them at the end of the run; other skips are untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffspec.settings import REPO_ROOT, SHARED_DIR

MISSING = SHARED_DIR / "data" / "no-such-eval-file.jsonl"  # absent whether or not ../shared is there
TESTS = f'''
import pytest
from pathlib import Path
from tests.conftest import shared_file

def test_through_the_helper():
    shared_file(Path({str(MISSING)!r}))

def test_with_its_own_skip():
    pytest.skip("{MISSING} not present")

def test_skipped_for_another_reason():
    pytest.skip("needs a CUDA/ROCm GPU")
'''


def run_pytest(tmp_path: Path, require: str | None, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_data_driven.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "DIFFSPEC_REQUIRE_SHARED"}
    if require is not None:
        env["DIFFSPEC_REQUIRE_SHARED"] = require
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    for coverage in ("COV_CORE_SOURCE", "COVERAGE_PROCESS_CONFIG"):  # no coverage of this inner run
        env.pop(coverage, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-rs", *options,
         "--rootdir", str(tmp_path), str(tmp_path / "test_data_driven.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_required_shared_data_fails_the_tests_that_miss_it(tmp_path):
    run = run_pytest(tmp_path, "1")
    assert run.returncode == 1, run.stdout
    assert "2 failed, 1 skipped" in run.stdout, run.stdout
    assert run.stdout.count("DIFFSPEC_REQUIRE_SHARED=1, so a data-driven test must find its data") == 2
    assert "data-driven tests skipped" not in run.stdout


@pytest.mark.parametrize("options", [(), ("-n", "2")], ids=["one-process", "two-workers"])  # -n 2: as .ci/run
def test_without_the_requirement_they_skip_and_the_run_ends_with_a_warning(tmp_path, options):
    run = run_pytest(tmp_path, None, *options)
    assert run.returncode == 0, run.stdout
    assert "3 skipped" in run.stdout, run.stdout
    warning = run.stdout[run.stdout.index("WARNING: data-driven tests skipped"):]
    assert f"2 tests did not run: {SHARED_DIR}" in warning
    assert "test_through_the_helper" in warning and "test_with_its_own_skip" in warning
    assert "test_skipped_for_another_reason" not in warning

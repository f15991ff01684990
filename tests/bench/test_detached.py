"""bench/detached.sh: a job outlives the command that started it, and each poll brings back its folder."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def detached(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(["bash", "bench/detached.sh", *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_job_runs_on_after_start_returns_and_poll_packs_its_folder(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DETACHED_ROOT": str(tmp_path / "copy")}
    job = "test -e bench/detached.sh; echo started; sleep 3; echo $? > results/job/made; echo ended; exit 3"
    assert "detached: running" in detached("start", "results/job", "0", job, env=env)
    polled = detached("poll", "results/job", "30", env=env)
    assert "ended" in polled and "detached: ended, rc 3" in polled
    with tarfile.open(tmp_path / "out" / "job.tgz") as packed:
        assert packed.extractfile("results/job/job.rc").read().decode().strip() == "3"
        assert packed.extractfile("results/job/made").read().decode().strip() == "0"  # ran in the repository's copy
        assert b"started" in packed.extractfile("results/job/job.log").read()


def test_a_wrong_call_is_refused_with_its_usage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DETACHED_ROOT": str(tmp_path / "copy")}
    done = subprocess.run(["bash", "bench/detached.sh", "start", "results/job"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "usage" in done.stderr


def test_a_poll_on_a_machine_without_the_job_says_so_at_once(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DETACHED_ROOT": str(tmp_path / "copy")}
    done = subprocess.run(["bash", "bench/detached.sh", "poll", "results/job", "600"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 3 and "machine was released" in done.stderr


def test_a_file_over_8_mib_stays_on_the_machine_and_the_rest_comes_back(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DETACHED_ROOT": str(tmp_path / "copy")}
    job = "head -c 8388608 /dev/zero > results/job/weights.bin; head -c 8388607 /dev/zero > results/job/just_under.bin"
    detached("start", "results/job", "30", job, env=env)
    polled = detached("poll", "results/job", "30", env=env)
    assert "left on the machine: results/job/weights.bin (8388608 bytes)" in polled
    with tarfile.open(tmp_path / "out" / "job.tgz") as packed:
        names = set(packed.getnames())
    assert "results/job/just_under.bin" in names and "results/job/job.rc" in names
    assert "results/job/weights.bin" not in names

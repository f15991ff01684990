"""bench/gpu_round.sh: the parts of a lent GPU's round, in order, each test log headed as RESULTS.md quotes it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gpu_round(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", **(env or {})}
    return subprocess.run(["bash", "bench/gpu_round.sh", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_every_part_in_order_with_each_test_log_headed_by_card_date_commit_and_command(tmp_path):
    done = gpu_round(str(tmp_path))
    assert done.returncode == 0, done.stderr
    parts = [line for line in done.stdout.splitlines() if line.startswith("gpu_round: ")]
    assert parts == ["gpu_round: tests", "gpu_round: times", "gpu_round: protocol"]
    draft = (tmp_path / "gpu_tests_draft.log").read_text().splitlines()
    assert draft[0].startswith("# ") and len(draft[0].split(", ")) == 3  # card, date, commit
    assert draft[1].endswith("-m gpu -p no:cacheprovider -o addopts= --continue-on-collection-errors -rf "
                             "--durations=5 tests/draft_service")  # fmt: skip
    assert "tests/diffspec_kernels" in (tmp_path / "gpu_tests_target_kernels_exactness.log").read_text()
    protocol = next(line for line in done.stdout.splitlines() if "bench.reproduce" in line)
    assert "DIFFSPEC_DRAFT_QUANTIZATION=auto" in protocol and "--context-targets 65536 4096 16384" in protocol
    assert "--tune-prompts 4 --tune-prompts-at 4096=8 16384=8 " in protocol  # the shorter contexts on more prompts
    assert f"--out-dir {tmp_path}/reproduce --judge-minutes 2" in protocol


def test_named_parts_alone_and_the_protocol_s_contexts_from_the_environment(tmp_path):
    done = gpu_round(str(tmp_path), "protocol", env={"CONTEXTS": "4096", "JUDGE_MINUTES": "0"})
    assert done.returncode == 0, done.stderr
    assert "gpu_round: tests" not in done.stdout and not list(tmp_path.glob("gpu_tests_*.log"))
    assert "--context-targets 4096 --out-dir" in done.stdout and "--judge-minutes 0" in done.stdout
    assert "--tune-prompts-at 4096=8 " in done.stdout
    longest = gpu_round(str(tmp_path), "protocol", env={"CONTEXTS": "65536"})
    assert "--tune-prompts-at" not in longest.stdout  # no override for a context not run


def test_the_tests_part_runs_only_the_test_parts_named(tmp_path):
    done = gpu_round(str(tmp_path), "tests", env={"TESTS": "draft"})
    assert done.returncode == 0, done.stderr
    assert [log.name for log in tmp_path.glob("gpu_tests_*.log")] == ["gpu_tests_draft.log"]
    assert "tests/draft_service" in done.stdout and "tests/diffspec_kernels" not in done.stdout


def test_a_wrong_call_is_refused(tmp_path):
    assert gpu_round().returncode == 2 and "usage" in gpu_round().stderr
    unknown = gpu_round(str(tmp_path), "bench")
    assert unknown.returncode == 2 and "unknown part bench" in unknown.stderr


def test_the_judge_part_resumes_the_protocols_run_with_its_own_limit(tmp_path):
    done = gpu_round(str(tmp_path), "protocol", "judge", env={"JUDGE_MORE_MINUTES": "9"})
    assert done.returncode == 0, done.stderr
    protocol, judge = [line for line in done.stdout.splitlines() if "bench.reproduce" in line]
    assert protocol.endswith(f"--out-dir {tmp_path}/reproduce --judge-minutes 2")
    assert judge == protocol.removesuffix("--judge-minutes 2") + "--resume --judge-minutes 9"  # the same flags
    default = gpu_round(str(tmp_path), "judge")
    assert default.stdout.rstrip().endswith("--resume --judge-minutes 6")


def test_the_judge_part_unpacks_a_carried_gzipped_runs_file_only_where_the_plain_one_is_missing(tmp_path):
    (tmp_path / "reproduce").mkdir()
    (tmp_path / "reproduce" / "runs.jsonl.gz").write_bytes(b"")
    packed = gpu_round(str(tmp_path), "judge").stdout.splitlines()
    assert packed[1] == f"gunzip -k {tmp_path}/reproduce/runs.jsonl.gz" and "--resume" in packed[2]
    (tmp_path / "reproduce" / "runs.jsonl").write_text("")
    plain = gpu_round(str(tmp_path), "judge").stdout
    assert "gunzip" not in plain and "--resume" in plain

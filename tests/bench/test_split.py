"""``bench.split`` end to end on CPU: three processes on loopback, the bundled tiny pair."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.split import AUTO, SPECULATIVE, main
from diffspec.settings import REPO_ROOT


@pytest.mark.slow
def test_split_bench_runs_both_modes_with_equal_outputs_and_counts_the_wire(
    code_prompts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIFFSPEC_DRAFT_TIMEOUT_SECONDS", "60")  # on a busy machine a slow draft is not a late one
    out = tmp_path / "split.json"
    argv = [
        "--base-model", str(REPO_ROOT / "models/tiny-code"),
        "--draft-model", str(REPO_ROOT / "models/tiny-code-eagle3"),
        "--data", str(code_prompts),
        "--streams", "2",
        "--prompt-tokens", "256",
        "--max-new-tokens", "8",
        "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    runs = {row["mode"]: row for row in result["runs"]}
    assert set(runs) == {AUTO, SPECULATIVE}
    assert result["outputs_equal"] == {"2": True}
    for row in runs.values():
        assert row["streams"] == 2 and row["tokens"] == 2 * 8 and row["tokens_per_s"] > 0
        target = row["wire"]["target"]
        assert target["prefill"]["steps"] >= 1 and target["decode"]["steps"] >= 1
        assert target["decode"]["bytes_sent_per_step"] > 0 and target["decode"]["bytes_received_per_step"] > 0
    draft = runs[SPECULATIVE]["wire"]["draft"]
    assert draft["prefill"]["steps"] >= 1 and draft["decode"]["steps"] >= 1
    # the draft's session starts carry the prompts' features; its replies carry the trees
    assert draft["prefill"]["bytes_sent_per_step"] > draft["decode"]["bytes_sent_per_step"] > 0
    assert draft["decode"]["bytes_received_per_step"] > 0
    assert runs[AUTO]["wire"]["draft"]["decode"]["steps"] == 0  # Auto never calls the draft

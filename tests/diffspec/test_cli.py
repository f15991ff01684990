"""The ``diffspec`` command line: the generate JSON contract and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diffspec.cli", *args], capture_output=True, text=True, timeout=180
    )


def test_generate_in_process_json_contract():
    outputs = {}
    for policy in ("auto", "full"):
        run = run_cli("generate", "--in-process", "--policy", policy, "--prompt", "def fibonacci(n):",
                      "--max-new-tokens", "24", "--json")
        assert run.returncode == 0, run.stderr
        lines = [json.loads(line) for line in run.stdout.splitlines()]
        final = lines[-1]
        assert set(final) == {"token_ids", "text", "stats"} and len(final["token_ids"]) == 24
        assert [t for line in lines[:-1] for t in line["token_ids"]] == final["token_ids"]
        assert final["text"].startswith("".join(line["text"] for line in lines[:-1]))  # deltas, then the whole
        assert final["stats"]["new_tokens"] == 24 and final["stats"]["finish_reason"] == "length"
        outputs[policy] = final["token_ids"]
    assert outputs["full"] == outputs["auto"]


def test_bad_settings_exit_2_with_a_message():
    run = run_cli("generate", "--in-process", "--prompt", "x", "--config", "64:abc:8", "--policy", "full")
    assert run.returncode == 2 and "bad tree config '64:abc:8'" in run.stderr
    run = run_cli("generate", "--in-process", "--prompt", "x", "--base-model", "/no/such/model")
    assert run.returncode == 2 and "/no/such/model does not exist" in run.stderr

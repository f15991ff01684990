"""The ``diffspec`` command line run as a user runs it: the generate JSON contract, the speed line,
errors found before any model loads, Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from diffspec.settings import REPO_ROOT

PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):"


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
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
        assert run.stderr == ""  # the stats are in the JSON, nowhere else
        outputs[policy] = final["token_ids"]
    assert outputs["full"] == outputs["auto"]


def test_generate_prints_the_continuation_then_one_speed_line():
    run = run_cli("generate", "--prompt", PROMPT, "--max-new-tokens", "32", "--vs-auto")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("\n        self.items.append(item)")  # the bundled model's real continuation
    (line,) = run.stderr.splitlines()
    assert line.startswith("32 tokens, ") and " tokens/s, tau " in line and "x Auto (" in line
    assert line.endswith("same tokens)")  # greedy speculation is Auto's output


def test_the_prompt_file_and_stop_sequences():
    prompt_file = REPO_ROOT / "models" / "tiny-code" / "README.md"
    run = run_cli("generate", "--prompt-file", str(prompt_file), "--policy", "chain", "--max-new-tokens", "64",
                  "--stop", "\n", "--json")
    assert run.returncode == 0, run.stderr
    final = json.loads(run.stdout.splitlines()[-1])
    assert final["stats"]["finish_reason"] == "stop" and "\n" not in final["text"]
    missing = run_cli("generate", "--prompt-file", "/no/such/prompt.txt")
    assert missing.returncode == 2 and "cannot read --prompt-file" in missing.stderr


@pytest.mark.slow
def test_samples_logprobs_and_stop_token_ids_in_json():
    """--n: one last line per sample, tagged with its index, sample 0 equal to the lone run with the seed;
    --logprobs: one entry per token; --stop-token-ids: the output ends before the first listed id."""
    sampled = ("--prompt", "def fibonacci(n):", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "5",
               "--policy", "full", "--json")  # fmt: skip
    run = run_cli("generate", *sampled, "--n", "2", "--logprobs", "1")
    assert run.returncode == 0, run.stderr
    finals = [line for line in map(json.loads, run.stdout.splitlines()) if "stats" in line]
    assert sorted(final["index"] for final in finals) == [0, 1]
    for final in finals:
        logprobs = final["logprobs"]
        assert len(logprobs["logprobs"]) == len(logprobs["top_ids"]) == len(final["token_ids"]) == 8
    by_index = {final["index"]: final["token_ids"] for final in finals}
    alone = json.loads(run_cli("generate", *sampled).stdout.splitlines()[-1])
    assert alone["token_ids"] == by_index[0] and "index" not in alone and "logprobs" not in alone
    stop = by_index[0][4]
    stopped = json.loads(run_cli("generate", *sampled, "--stop-token-ids", str(stop)).stdout.splitlines()[-1])
    assert stopped["token_ids"] == by_index[0][: by_index[0].index(stop)]
    assert stopped["stats"]["finish_reason"] == "stop"


def test_bad_input_is_refused_before_any_model_loads():
    """Each of these exits 2 with one line naming the problem, without importing torch."""
    for args, message in [
        (["generate", "--prompt", "x", "--tree-config", "64:abc:8", "--policy", "auto"], "bad tree config '64:abc:8'"),
        (["generate", "--prompt", "x", "--policy", "sideways"], "unknown policy 'sideways'"),
        (["generate", "--prompt", ""], "the prompt is empty"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature: Input should be greater than or equal"),
        (["generate", "--prompt", "x", "--temperature", "inf"], "--temperature: Input should be a finite number"),
        (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: Input should be greater than 0"),
        (["generate", "--prompt", "x", "--logprobs", "21"], "--logprobs: Input should be less than or equal to 20"),
        (["generate", "--prompt", "x", "--n", "2", "--vs-auto"], "--vs-auto compares one sample"),
        (["generate", "--prompt", "x", "--num-pages", "0"], "--num-pages (or DIFFSPEC_NUM_PAGES): Input should be"),
        (["generate", "--prompt", "x", "--gateway", "127.0.0.1:1", "--dtype", "float32"], "--dtype: in-process"),
        (["serve", "--listen", "127.0.0.1:99999"], "--listen must be HOST:PORT with a port in [0, 65535]"),
        (["serve", "--tree-config", "64:0.1"], "bad tree config '64:0.1'"),
        (["serve", "--cuda-graphs", "maybe"], "argument --cuda-graphs: expected on or off"),
    ]:
        started = time.monotonic()
        run = _run_without_torch(args)
        assert run.returncode == 2, (args, run.stderr)
        assert message in run.stderr and "https://" not in run.stderr, (args, run.stderr)
        assert run.stdout.strip().splitlines()[-1] == "torch imported: False", (args, run.stdout)
        assert time.monotonic() - started < 10


def _run_without_torch(args: list[str]) -> subprocess.CompletedProcess:
    """``main(args)``, then a line saying whether torch was imported on the way."""
    code = (
        "import sys\nfrom cli.main import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    rc = e.code\nprint('torch imported:', 'torch' in sys.modules)\nsys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_help_imports_neither_torch_nor_the_services():
    for args in (["--help"], ["generate", "--help"], ["serve", "--help"]):
        run = _run_without_torch(args)
        assert run.returncode == 0 and run.stdout.splitlines()[-1] == "torch imported: False", (args, run.stdout)


def test_a_missing_model_is_one_error_line():
    run = run_cli("generate", "--prompt", "x", "--base-model", "/no/such/model")
    assert run.returncode == 2 and "/no/such/model does not exist" in run.stderr
    assert "Traceback" not in run.stderr


def test_ctrl_c_prints_one_line():
    process = subprocess.Popen(
        [sys.executable, "-m", "cli", "generate", "--prompt", PROMPT, "--max-new-tokens", "10000", "--policy", "auto"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert process.stdout.read(1)  # generating
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert [line for line in stderr.splitlines() if line] == ["diffspec: interrupted"]


def test_connection_flags_reach_a_gateway():
    """TLS and token flags are how generate reaches a gateway, not model flags: the call is made (and fails to connect)."""
    run = run_cli("generate", "--gateway", "127.0.0.1:1", "--auth-token", "t", "--prompt", "x", timeout=60)
    assert run.returncode != 0 and "gateway unavailable" in run.stderr and "in-process" not in run.stderr, run.stderr


def test_training_a_head_imports_no_grpc():
    """A training machine's grpcio may not match the stubs' (their import refuses it): train-draft and the
    trainer load without them."""
    code = "import sys, cli.main, draft_service.trainer; print(sorted(m for m in sys.modules if 'grpc' in m))"
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr

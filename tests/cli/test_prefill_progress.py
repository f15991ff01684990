"""A prompt of several prefill chunks through a gateway: the CLI draws the progress the gateway streams
(a ``prefill`` bar on stderr, in prompt tokens) before the continuation; stdout holds only the text."""

from __future__ import annotations

import subprocess
import sys

from diffspec.settings import REPO_ROOT

FUNCTION = "def f{0}(x):\n    return x + {0}\n\n\n"


def test_a_long_prompt_shows_prefill_progress_through_a_gateway(live_gateway, tmp_path):
    prompt = "".join(FUNCTION.format(i) for i in range(200))  # 2,781 tokens: two chunks of at most 2,048
    prompt_file = tmp_path / "prompt.py"
    prompt_file.write_text(prompt)
    num_tokens = len(live_gateway.engine.tokenizer(prompt)["input_ids"])
    assert 2048 < num_tokens < 4096  # more than one chunk, within the live gateway's 256 pages
    run = subprocess.run(
        [sys.executable, "-m", "cli", "generate", "--gateway", live_gateway.address, "--prompt-file", str(prompt_file),
         "--max-new-tokens", "8"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    bar = [line for line in run.stderr.splitlines() if line.startswith("prefill:")]
    assert bar and f"| 0/{num_tokens} " in bar[0], run.stderr  # tqdm draws later counts when its clock allows
    assert run.stdout.startswith("def f") and "prefill" not in run.stdout, run.stdout  # the continuation alone

"""bench/fp32_cost.py on the bundled tiny pair: per backend and length, the fp32 run's prefill and decode apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET

REPO = Path(__file__).resolve().parents[2]


def test_reports_each_backend_and_length_with_prefill_and_decode_apart(tmp_path):
    out = tmp_path / "fp32_cost.json"
    command = [sys.executable, "-m", "bench.fp32_cost", "--base-model", str(BUNDLED_TARGET), "--draft-model",
               str(BUNDLED_DRAFT), "--prompt-tokens", "96", "160", "--max-new-tokens", "5", "--backends", "torch",
               "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["prompt_tokens"]) for r in rows] == [("torch", 96), ("torch", 160)]
    for row in rows:
        assert row["steps"] == 4  # the first token comes from the prefill, each later one from a decode step
        assert row["prefill_s"] > 0 and row["decode_ms_per_step"] > 0
        # from the unrounded seconds: within the rounding of the millisecond shown
        assert row["prefill_tokens_per_s"] == pytest.approx(row["prompt_tokens"] / row["prefill_s"], rel=0.1)

"""The online policy beside full along the target's text under a frozen cost model: the model, the flags, and
agreement with the drafter's own walk on the bundled pair (CPU)."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.forced_acceptance import drafted_steps, target_text
from bench.online_replay import frozen_cost, main, milliseconds_arg, replay
from diffspec.settings import DiffSpecSettings
from draft_service.options import DraftOptions
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import Candidate
from gateway.assembly import build_draft, build_target, load_tokenizer
from tests.conftest import CODE_PROMPTS


@pytest.mark.parametrize("bad", ["16=7", "16:7,32:9", "a=1,b=2", "16=7,32=-1", "0=1,2=3"])
def test_a_cost_flag_is_two_or_more_positive_points(bad):
    assert milliseconds_arg("16=7.5,32=10") == {16: 7.5, 32: 10.0}
    with pytest.raises(argparse.ArgumentTypeError):
        milliseconds_arg(bad)


def test_the_frozen_cost_prices_as_measured_and_learns_nothing():
    cost = frozen_cost({16: 7.0, 32: 10.0}, {6: 1.2, 10: 2.0}, 0.3)
    priced = (cost.verify_seconds(16), cost.verify_seconds(32), cost.draft_seconds(8), cost.step_overhead_seconds)
    assert priced == pytest.approx((0.007, 0.010, 0.0016, 0.0003))
    cost.observe_verify(32, 1.0)
    cost.observe_draft(10, 1.0)
    cost.observe_step(5.0, 1.0, 1.0)
    assert (cost.verify_seconds(16), cost.verify_seconds(32), cost.draft_seconds(8), cost.step_overhead_seconds) == priced
    padded = frozen_cost({16: 7.0, 32: 10.0}, {6: 1.2, 10: 2.0}, 0.3, graph_tree_sizes=(8, 16, 32, 64))
    assert (padded.computed_rows(1, 19), cost.computed_rows(1, 19)) == (32, 19)  # a 19-node tree runs the 32 graph


def test_the_full_arm_takes_the_drafters_own_steps_and_online_runs_beside_it():
    """Through the runtime, ``full`` accepts along the text exactly what the drafter's walk does; ``online`` runs
    on the same runtime after it, and each request's session is released."""
    settings = DiffSpecSettings()
    target = build_target(settings)
    runtime = build_draft(settings, target)
    runtime.step_cost = frozen_cost({16: 7.0, 32: 10.0}, {6: 1.2, 10: 2.0}, 0.3)
    ids = load_tokenizer(settings)(CODE_PROMPTS[1])["input_ids"]
    new_tokens = 24
    text = target_text(target, ids, new_tokens)
    full = replay(runtime, text, new_tokens, DraftOptions("full", "16:0.0:4"), prompt=1)
    counts = drafted_steps(runtime.drafter, text, new_tokens, Candidate.dynamic(TreeBudget.parse("16:0.0:4")), None)
    assert (full.steps, full.tokens) == (len(counts), sum(counts) + len(counts))
    assert [step.emitted for step in full.per_step] == [n + 1 for n in counts]
    assert {(step.tree, step.depth) for step in full.per_step} == {("full 16:0.0:4", 4)}
    online = replay(runtime, text, new_tokens, DraftOptions("online", "16:0.0:4"), prompt=1)
    assert online.tokens >= new_tokens - 1 and online.seconds > 0 and not runtime.sessions
    assert sum(step.emitted for step in online.per_step) == online.tokens and len(online.per_step) == online.steps
    assert full.seconds >= full.steps * (0.0003 + 0.007)  # each step: the overhead and at least the smallest verify


def test_main_writes_both_arms_per_prompt_and_a_plot(code_prompts, tmp_path):
    out = tmp_path / "replay.json"
    assert main(["--base-model", "models/tiny-code", "--draft-model", "models/tiny-code-eagle3", "--data",
                 str(code_prompts), "--length", "256", "--prompts", "2", "--max-new-tokens", "12", "--tree-config",
                 "16:0.0:4", "--working-set", "whole", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert [(r["prompt"], r["arm"]) for r in result["runs"]] == [(p, a) for p in (0, 1) for a in ("full", "online")]
    assert set(result["summary"]) == {"full", "online"} and all(r["tau"] >= 1 for r in result["runs"])
    assert out.with_suffix(".png").stat().st_size > 0
    emitted = result["per_step_fields"].index("emitted")
    assert all(sum(row[emitted] for row in r["per_step"]) == r["tokens"] for r in result["runs"])

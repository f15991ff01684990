"""Acceptance along the target's greedy text: the tree walk, the argument checks, and agreement with the engine
on the bundled pair (CPU)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch

from bench.forced_acceptance import (
    accepted_path,
    cached_text,
    drafted_steps,
    main,
    read_at_roots,
    salience_of,
    shaped_tree_arg,
    target_text,
    working_set_arg,
)
from bench.reproduce.arms import baseline_arms
from bench.reproduce.runs import generate_run
from diffspec.errors import InvalidRequest
from diffspec.settings import DiffSpecSettings
from diffspec.tree import DraftTree
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import Candidate
from gateway.assembly import build_draft, build_engine, build_target, load_tokenizer
from tests.conftest import CODE_PROMPTS

# root 0 -> 1 (token 5) -> 3 (token 7) -> 4 (token 8); root -> 2 (token 6) -> 5 (token 7)
TREE = DraftTree(
    tokens=torch.tensor([0, 5, 6, 7, 8, 7]),
    parents=torch.tensor([-1, 0, 0, 1, 3, 2]),
    draft_probs=torch.ones(6),
)


@pytest.mark.parametrize(
    ("following", "accepted"),
    [
        ([5, 7, 8, 9], [5, 7, 8]),  # the deepest path, then a token no leaf has
        ([6, 7, 8], [6, 7]),  # the other branch: its 7 has no child
        ([5, 6], [5]),  # 6 is the root's child, not node 1's
        ([9, 5], []),
        ([], []),
    ],
)
def test_the_accepted_path_follows_the_text_from_the_root(following, accepted):
    assert accepted_path(TREE, following) == accepted


@pytest.mark.parametrize("bad", ["2048", "a:b", "0:256", "2048:-1", "2048:256:1"])
def test_a_working_set_spec_is_whole_or_a_budget_and_a_recent_window(bad):
    assert working_set_arg("whole") == "whole" and working_set_arg("2048:256") == "2048:256"
    assert salience_of(working_set_arg("2048:0"), DiffSpecSettings()).recent_chunks == 2048 * 3 // 4 // 64  # default
    with pytest.raises(argparse.ArgumentTypeError):
        working_set_arg(bad)


def test_a_working_set_too_small_for_its_recent_window_is_refused():
    with pytest.raises(InvalidRequest, match="recent"):
        salience_of("256:1024", DiffSpecSettings())


def test_drafting_along_the_target_s_text_takes_the_engine_s_steps():
    """At temperature 0 the engine's generation is the target's greedy text, and each of its steps accepts the
    path of the tree that text follows: the same steps and accepted drafts, per configuration, as the engine's
    own run (the working set small enough to select on a short prompt)."""
    settings = DiffSpecSettings(chunk_size=16, working_set_tokens=128, salience_recent_tokens=32)
    ids = load_tokenizer(settings)("\n\n".join(CODE_PROMPTS) * 3)["input_ids"]  # ~200 tokens: 12 chunks for 6 slots
    new_tokens, tree = 24, "16:0.0:4"
    engine = build_engine(settings)
    try:
        arms = baseline_arms(tree)
        runs = {name: asyncio.run(generate_run(engine, ids, arms[name], new_tokens))
                for name in ("eagle3", "eagle3+salience")}  # fmt: skip
    finally:
        engine.close()
    target = build_target(settings)
    drafter = build_draft(settings, target).drafter
    text = target_text(target, ids, new_tokens)
    assert text.continuation[:new_tokens] == runs["eagle3"].token_ids
    for name, spec in (("eagle3", "whole"), ("eagle3+salience", "128:32")):
        dynamic = Candidate.dynamic(TreeBudget.parse(tree))
        counts = drafted_steps(drafter, text, new_tokens, dynamic, salience_of(spec, settings))
        assert (len(counts), sum(counts)) == (runs[name].stats.steps, runs[name].stats.accepted_drafts), name
    assert sum(counts) > 0


def test_a_second_run_drafts_from_the_cached_target_passes(code_prompts, tmp_path, monkeypatch):
    argv = ["--base-model", "models/tiny-code", "--draft-model", "models/tiny-code-eagle3", "--data", str(code_prompts),
            "--lengths", "512", "--prompts", "1", "--max-new-tokens", "12", "--tree-configs", "8:0.0:3",
            "--working-sets", "whole", "256:64", "--cache", str(tmp_path / "cache")]  # fmt: skip
    assert main([*argv, "--out", str(tmp_path / "first.json")]) == 0

    def no_target_pass(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the target pass was cached")

    monkeypatch.setattr("bench.forced_acceptance.target_text", no_target_pass)
    assert main([*argv, "--out", str(tmp_path / "second.json")]) == 0
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    assert first["runs"] == second["runs"] and len(first["runs"]) == 2
    assert [s["working_set"] for s in first["summaries"]] == ["256:64", "whole"]
    assert all(s["tau"] >= 1 and s["steps"] > 0 for s in first["summaries"])
    assert (tmp_path / "first.png").stat().st_size > 0


def test_a_cached_pass_is_read_back_only_for_its_own_target_prompt_and_length(tmp_path, monkeypatch):
    settings = DiffSpecSettings()
    target = build_target(settings)
    ids = load_tokenizer(settings)(CODE_PROMPTS[1])["input_ids"]
    made = cached_text(target, ids, 6, tmp_path, "k")
    saved = (tmp_path / "k.pt").read_bytes()
    passes = []
    monkeypatch.setattr("bench.forced_acceptance.target_text", lambda *args: passes.append(args) or made)
    again = cached_text(target, ids, 6, tmp_path, "k")
    assert passes == [] and again.continuation == made.continuation and torch.equal(again.features, made.features)
    for prompt, n, model in ((ids, 7, target.model_path), (ids[1:], 6, target.model_path), (ids, 6, "another")):
        (tmp_path / "k.pt").write_bytes(saved)  # the first pass's file each time
        monkeypatch.setattr(target, "model_path", model)
        cached_text(target, prompt, n, tmp_path, "k")
    assert len(passes) == 3


@pytest.mark.parametrize("text", ["3,x,1", "", "0,1", "3,,1"])
def test_a_shaped_tree_flag_names_what_is_wrong(text):
    with pytest.raises(argparse.ArgumentTypeError, match="width"):
        shaped_tree_arg(text)


def test_shaped_and_full_trees_draft_side_by_side(code_prompts, tmp_path):
    """A static tree of given widths drafts as the ``online`` policy's shaped candidate does: its own row and
    summary, labelled by its widths, with the tokens its plan holds (3 + 3 x 2 + 2 x 1 + 1 x 1 past the root)."""
    out = tmp_path / "shaped.json"
    argv = ["--base-model", "models/tiny-code", "--draft-model", "models/tiny-code-eagle3", "--data", str(code_prompts),
            "--lengths", "512", "--prompts", "1", "--max-new-tokens", "12", "--tree-configs", "13:0.0:4",
            "--shaped-trees", "3,2,1,1", "--working-sets", "whole", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    full, shaped = result["runs"]
    assert (full["tree"], shaped["tree"]) == ("full 13:0.0:4", "shaped 3,2,1,1")
    assert shaped["tree_config"] == "13:0.0:4" and shaped["tree_tokens"] == 13 == full["tree_tokens"]
    assert [s["tree"] for s in result["summaries"]] == ["full 13:0.0:4", "shaped 3,2,1,1"]
    assert all(1 <= s["tau"] <= 5 and s["steps"] > 0 for s in result["summaries"])


def test_a_tree_read_at_its_own_roots_is_its_own_run_and_a_smaller_one_at_most_the_larger(code_prompts, tmp_path):
    """``--read-at-roots-of``: each budget inside the larger one gets a row read at the larger tree's roots, over
    the larger tree's steps; the larger tree read at its own roots accepts what its own run does, and a smaller
    tree inside it never more than it at any root (a counterfactual is a prefix of the accepted path)."""
    out = tmp_path / "roots.json"
    argv = ["--base-model", "models/tiny-code", "--draft-model", "models/tiny-code-eagle3", "--data", str(code_prompts),
            "--lengths", "512", "--prompts", "1", "--max-new-tokens", "16", "--tree-configs", "4:0.0:2", "12:0.0:4",
            "--read-at-roots-of", "12:0.0:4", "--working-sets", "whole", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {row["tree"]: row for row in json.loads(out.read_text())["runs"]}
    own, small = rows["full 12:0.0:4"], rows["full 4:0.0:2"]
    at_own = rows["full 12:0.0:4 at full 12:0.0:4's roots"]
    at_large = rows["full 4:0.0:2 at full 12:0.0:4's roots"]
    assert (at_own["steps"], at_own["accepted_per_step"]) == (own["steps"], own["accepted_per_step"])
    assert at_large["steps"] == own["steps"] and at_large["tree_config"] == "4:0.0:2"
    pairs = zip(at_large["accepted_per_step"], own["accepted_per_step"])
    assert all(small_step <= min(large_step, 2) for small_step, large_step in pairs)
    assert sum(small["accepted_per_step"]) == small["accepted"] and len(small["accepted_per_step"]) == small["steps"]
    assert own["accepted"] > 0


def test_read_at_roots_needs_a_budget_inside_it(code_prompts, tmp_path, capsys):
    argv = ["--base-model", "models/tiny-code", "--draft-model", "models/tiny-code-eagle3", "--data", str(code_prompts),
            "--tree-configs", "16:0.0:6", "--read-at-roots-of", "8:0.0:3", "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit):
        main(argv)
    assert "--read-at-roots-of 8:0.0:3: no --tree-configs budget inside it" in capsys.readouterr().err


def test_read_at_roots_counts_per_step_what_each_inside_budget_accepts():
    """Per step of the larger tree, each inside budget's counterfactual: the larger one's own accepted drafts, and
    for a budget one depth deep at most 1."""
    settings = DiffSpecSettings()
    target = build_target(settings)
    drafter = build_draft(settings, target).drafter
    text = target_text(target, load_tokenizer(settings)(CODE_PROMPTS[0])["input_ids"], 12)
    large = Candidate.dynamic(TreeBudget.parse("12:0.0:4"))
    steps = read_at_roots(drafter, text, 12, large, [large.budget, TreeBudget.parse("4:0.0:1")], None)
    assert [step[0] for step in steps] == drafted_steps(drafter, text, 12, large, None)
    assert all(0 <= step[1] <= min(1, step[0]) for step in steps)

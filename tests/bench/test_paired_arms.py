"""bench.paired's configurations: every speculative one drafts within ``--tree-config``; runs above temperature 0
sample, each prompt with its own seed, and give Auto's sampled tokens."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import pytest

from bench.paired import arms_at, main, run_all, tree_config_arg
from bench.reproduce.prompts import Dataset
from diffspec.settings import BUNDLED_DRAFT, BUNDLED_TARGET, DiffSpecSettings
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import Bound, Candidate
from gateway.assembly import build_engine, load_tokenizer


def test_every_speculative_configuration_drafts_within_the_tree_config() -> None:
    arms = arms_at("96:0.0:12")
    assert arms["auto"].draft is None
    drafted = {name: (arm.draft.policy, arm.draft.tree_config, arm.draft.salience)
               for name, arm in arms.items() if arm.draft is not None}  # fmt: skip
    assert drafted == {
        "chain": ("chain", "96:0.0:12", False),
        "eagle3": ("full", "96:0.0:12", False),
        "eagle3+salience": ("full", "96:0.0:12", True),
        "diffspec": ("online", "96:0.0:12", True),
    }
    assert arms["eagle3"].label == "eagle3[full 96:0.0:12]"


def test_the_tree_config_flag_reads_a_budget_or_names_what_is_wrong() -> None:
    assert tree_config_arg("64:0:12") == "64:0.0:12"
    with pytest.raises(argparse.ArgumentTypeError, match="depth must be in"):
        tree_config_arg("64:0.0:99")
    with pytest.raises(argparse.ArgumentTypeError):
        tree_config_arg("64-0-8")


def test_runs_above_temperature_zero_sample_auto_s_tokens() -> None:
    settings = DiffSpecSettings(num_pages=256)
    tokenizer, engine = load_tokenizer(settings), build_engine(settings)
    text = "def parse(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--name')\n" * 8
    dataset = Dataset("code", [tokenizer(text)["input_ids"]] * 2)
    arms = [arms_at("16:0.0:4")[name] for name in ("auto", "eagle3")]
    try:
        greedy = asyncio.run(run_all(engine, dataset, [96], 2, arms, 12))
        sampled = asyncio.run(run_all(engine, dataset, [96], 2, arms, 12, temperature=1.5))
        again = asyncio.run(run_all(engine, dataset, [96], 2, arms, 12, temperature=1.5))
    finally:
        engine.close()
    assert all(r.exactness is not None and r.exactness.verdict == "exact" for r in greedy if r.arm != "auto")
    assert all(r.exactness is not None and r.exactness.verdict == "exact" for r in sampled if r.arm != "auto")
    assert [r.token_ids for r in again] == [r.token_ids for r in sampled]  # seeded: a second run repeats the first
    assert any(r.token_ids != g.token_ids for r, g in zip(sampled, greedy))  # they did sample


def test_each_online_run_audits_the_bounds_it_proposed_within(capsys) -> None:
    """An ``online`` run records, per batch bound, the planner's prediction beside what the run's own steps
    delivered, and prints it; a fixed policy proposes within no online bound."""
    settings = DiffSpecSettings(num_pages=256)
    tokenizer, engine = load_tokenizer(settings), build_engine(settings)
    text = "def parse(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--name')\n" * 8
    arms = [arms_at("32:0.0:6")[name] for name in ("eagle3", "diffspec")]
    try:
        runs = asyncio.run(run_all(engine, Dataset("code", [tokenizer(text)["input_ids"]]), [96], 1, arms, 24))
    finally:
        engine.close()
    full, online = runs
    assert full.online_bound_audit == {}
    audit = online.online_bound_audit
    proposals = sum(bound["proposals"] for bound in audit.values())
    assert proposals >= online.stats.steps - 1  # every proposal of the run (its first may come from the warm-up's)
    assert sum(bound["realised_tokens_per_step"] is not None for bound in audit.values()) >= 1
    for key, bound in audit.items():
        tokens, depth = map(int, key.split(":"))
        realised = bound["realised_tokens_per_step"]
        assert tokens <= 96 and depth <= 10  # the candidate grid's largest
        assert realised is None or 1 <= realised <= depth + 1
    printed = capsys.readouterr().out
    assert all(f"  {online.label} bound {key}: " in printed for key in audit)
    assert full.online_choices == [] and online.online_choices  # its choices one by one, the start's first
    assert sum(bound["choices"] for bound in audit.values()) == len(online.online_choices)
    for choice in online.online_choices:
        assert choice["bound"] in choice["scored"]  # the bound taken is among those scored
        [expected] = choice["expected"]  # the one online session's E per candidate, its own tree among them
        assert "full 32:0.0:6" in expected and any(label.startswith("shaped ") for label in expected)
        assert choice["scored"][choice["bound"]]["tokens_per_step"] == pytest.approx(max(
            e for label, e in expected.items() if fits(label, choice["bound"])), abs=1e-3)
        assert all(s["tokens_per_s"] == pytest.approx(1000 * s["tokens_per_step"] / s["step_ms"], rel=0.01)
                   for s in choice["scored"].values())


def fits(label: str, bound: str) -> bool:
    """Whether the tree of a choice log's label ("full T:t:D" or "shaped w1,w2,...") fits a bound ("T:D")."""
    tokens, depth = map(int, bound.split(":"))
    kind, spec = label.split(" ")
    tree = Candidate.dynamic(TreeBudget.parse(spec)) if kind == "full" else Candidate.shaped(
        [int(w) for w in spec.split(",")], 0.0)
    return Bound(tokens, depth).fits(tree)


@pytest.mark.parametrize(("same", "indices"), [(False, [(32, 0), (96, 1)]), (True, [(32, 1), (96, 1)])])
def test_same_prompts_cut_the_texts_of_the_longest_length_to_every_length(same, indices) -> None:
    settings = DiffSpecSettings(num_pages=64)
    tokenizer, engine = load_tokenizer(settings), build_engine(settings, with_draft=False)
    ids = tokenizer("def parse(argv):\n    return argv\n" * 30)["input_ids"]
    dataset = Dataset("code", [ids[:40], ids[:120], ids[:100]])  # the first fills 32 tokens, not 96
    try:
        runs = asyncio.run(run_all(engine, dataset, [32, 96], 1, [arms_at("16:0.0:4")["auto"]], 2, same_prompts=same))
    finally:
        engine.close()
    assert [(r.context, r.prompt) for r in runs] == indices


def test_a_negative_temperature_is_refused_before_anything_loads(monkeypatch, capsys) -> None:
    argv = ["bench.paired", "--base-model", "nowhere", "--draft-model", "nowhere", "--data", "nowhere.jsonl",
            "--out", "nowhere.json", "--temperature", "-0.5"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2 and "--temperature must be at least 0" in capsys.readouterr().err


def test_the_results_hold_every_setting_the_environment_gave(monkeypatch, tmp_path, code_prompts, capsys) -> None:
    """A setting from a DIFFSPEC_* variable shapes the run but not its command line: the results record it. The
    draft is warmed as a server warms it (the trees an online session starts from) before any timed run."""
    out = tmp_path / "paired.json"
    monkeypatch.setenv("DIFFSPEC_SALIENCE_COMPACT_POSITIONS", "1")
    monkeypatch.setenv("DIFFSPEC_DRAFT_QUANTIZATION", "auto")  # a setting that has a flag too, not given
    monkeypatch.setattr("sys.argv", [
        "bench.paired", "--base-model", str(BUNDLED_TARGET), "--draft-model", str(BUNDLED_DRAFT), "--data",
        str(code_prompts), "--lengths", "512", "--prompts", "1", "--max-new-tokens", "16",
        "--configs", "auto", "eagle3+salience", "--working-set-tokens", "512", "--out", str(out)])  # fmt: skip
    assert main() == 0
    warmed = re.search(r"proposed (\d+) warm-up trees", capsys.readouterr().out)
    assert warmed is not None and int(warmed.group(1)) > 0
    result = json.loads(out.read_text())
    assert result["settings"]["salience_compact_positions"] is True
    assert result["settings"]["draft_quantization"] == "auto"
    assert result["settings"]["working_set_tokens"] == 512  # and the flags' own
    assert [s["arm"] for s in result["summaries"]] == ["auto", "eagle3+salience"]
    auto, speculative = result["runs"]
    # each speculative step's tree is recorded, the warm-up's none: [accepted, depth, tokens, ranks, stop width]
    # (all but the last: a request's last step reaches the draft as its release, with no accept to pair it with)
    assert auto["draft_steps"] == [] and len(speculative["draft_steps"]) == speculative["stats"]["steps"] - 1
    assert {tokens for _, _, tokens, _, _ in speculative["draft_steps"]} <= set(range(2, 65))

"""The smoke preset end to end on the CPU with the bundled tiny pair (the ``smoke_run`` fixture): files, arms,
speedups, exactness, the outside reference and the recorded draft steps."""

from __future__ import annotations

import weakref

import pytest

import bench.reproduce.protocol as protocol
from bench.reproduce.cli import main
from draft_service.options import DraftOptions
from draft_service.tuned_profile import load_tuned_profile

ARMS = ["auto", "eagle3", "eagle3+salience", "diffspec", "transformers"]


def test_writes_every_file(smoke_run):
    exit_code, out_dir, _ = smoke_run
    assert exit_code == 0
    assert {p.name for p in out_dir.iterdir()} == {"results.json", "results.md", "reproduce.log", "repo_code.png",
                                                 "tuned_profile.json", "runs.jsonl", "verdicts.jsonl", "protocol.json"}
    log = (out_dir / "reproduce.log").read_text()
    assert "tuned repo_code @ 1024" in log and "EXACTNESS FAILED" not in log


def test_the_tuned_profile_serves_the_chosen_candidate(smoke_run):
    _, out_dir, result = smoke_run
    chosen = next(s for s in result["tuning"] if s["chosen"])
    profile = load_tuned_profile(out_dir / "tuned_profile.json")
    assert profile.options_for(1024) == DraftOptions(chosen["policy"], chosen["tree_config"], salience=True)


def test_every_arm_is_summarised_and_tabled(smoke_run):
    _, out_dir, result = smoke_run
    assert [s["arm"] for s in result["summaries"]] == ARMS
    assert all(s["context"] == 1024 and s["prompts"] == 1 for s in result["summaries"])
    table = (out_dir / "results.md").read_text()
    for summary in result["summaries"]:
        assert f"| 1024 | {summary['label']} |" in table


def test_tuning_chooses_the_fastest_candidate_and_evaluates_it(smoke_run):
    _, _, result = smoke_run
    scores = result["tuning"]
    assert [s["label"] for s in scores] == ["diffspec[online 32:0.0:6]", "diffspec[online 64:0.0:8]"]
    chosen = [s for s in scores if s["chosen"]]
    assert len(chosen) == 1 and chosen[0]["decode_tokens_per_s"] == max(s["decode_tokens_per_s"] for s in scores)
    tuned = [r for r in result["runs"] if r["phase"] == "tune"]
    assert {r["prompt"] for r in tuned} == {1}  # tuned on the prompt after the evaluated one
    diffspec = next(s for s in result["summaries"] if s["arm"] == "diffspec")
    assert diffspec["label"] == chosen[0]["label"]


def test_speedups_come_from_the_recorded_times(smoke_run):
    _, _, result = smoke_run
    runs = {r["arm"]: r for r in result["runs"] if r["phase"] == "eval"}

    def decode(run):
        return (run["stats"]["new_tokens"] - 1) / run["stats"]["decode_seconds"]

    def end_to_end(run):
        return run["stats"]["new_tokens"] / run["request_seconds"]

    for summary in result["summaries"]:
        run = runs[summary["arm"]]
        assert summary["decode_speedup"] == pytest.approx(decode(run) / decode(runs["auto"]), rel=1e-3)
        assert summary["end_to_end_speedup"] == pytest.approx(end_to_end(run) / end_to_end(runs["auto"]), rel=1e-3)
        assert run["first_token_seconds"] <= run["request_seconds"]
        assert run["stats"]["prefill_seconds"] > 0


def test_fp32_arms_are_exact(smoke_run):
    _, _, result = smoke_run
    evaluated = [r for r in result["runs"] if r["phase"] == "eval"]
    auto = next(r for r in evaluated if r["arm"] == "auto")
    assert auto["exactness"] is None and len(auto["token_ids"]) == 16
    for run in evaluated:
        if run["arm"] != "auto":
            assert run["exactness"]["verdict"] == "exact"
            assert run["token_ids"] == auto["token_ids"]
    assert result["exactness"] == {"passed": True, "exact": 4, "near-tie": 0, "mismatch": 0, "unchecked": 0}
    assert [(s["exact"], s["near_ties"], s["mismatches"]) for s in result["summaries"]] == [(0, 0, 0)] + [(1, 0, 0)] * 4


def test_transformers_reference_is_reported_beside_auto(smoke_run):
    _, out_dir, result = smoke_run
    reference = next(s for s in result["summaries"] if s["arm"] == "transformers")
    assert reference["label"] == "transformers[generate float32]" and reference["tau"] == 1.0
    assert reference["decode_tokens_per_s"] > 0 and reference["end_to_end_tokens_per_s"] > 0
    assert reference["decode_speedup"] is not None and reference["end_to_end_speedup"] is not None
    assert "| 1024 | transformers[generate float32] |" in (out_dir / "results.md").read_text()


def test_drafting_runs_record_their_steps(smoke_run):
    _, _, result = smoke_run
    assert result["draft_step_fields"] == ["accepted", "tree_depth", "tree_tokens", "passed_ranks", "stop_width"]
    for run in result["runs"]:
        steps = run["draft_steps"]
        if run["arm"] in ("auto", "transformers"):
            assert steps == []
            continue
        # every step but the last was fed back to the draft; each kept its accepted drafts and one bonus
        assert len(steps) == run["stats"]["steps"] - 1
        assert sum(s[0] + 1 for s in steps) < run["stats"]["new_tokens"]
        for accepted, depth, tokens, ranks, stop_width in steps:
            assert 0 <= accepted <= depth < tokens and len(ranks) == accepted
            if accepted == depth:  # ran off the tree's end (a path can also end at a shallower leaf)
                assert stop_width == 0
    # one warm-up (one context) before the first run; a 4-token warm-up may end in its first step, feeding none
    assert [w["before_run"] for w in result["warmup_draft_steps"]] == [0]


def test_the_serving_engine_is_freed_before_the_judging_loads_its_models(code_prompts, tmp_path, monkeypatch):
    """At 64K an 8B target's fp32 replay beside a serving engine kept alive does not fit an 80 GB card."""
    engines: list[weakref.ref] = []  # the protocol's serving engine (other tests' may live in this process)
    alive_at_judging: list[bool] = []
    start = protocol._Protocol.__init__

    def tracked_start(self, config, engine, *rest, **named):  # noqa: ANN001, ANN002, ANN003, ANN202
        engines.append(weakref.ref(engine))
        start(self, config, engine, *rest, **named)

    free = protocol.free_gpu_memory
    monkeypatch.setattr(protocol._Protocol, "__init__", tracked_start)
    monkeypatch.setattr(protocol, "free_gpu_memory", lambda: (free(), alive_at_judging.append(engines[0]() is not None)))
    argv = ["--preset", "smoke", "--data-files", str(code_prompts), "--context-targets", "1024", "--prompts", "1",
            "--tune-max-new-tokens", "4", "--eval-max-new-tokens", "4", "--warmup-tokens", "2",
            "--reference-prompts", "0", "--out-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    assert alive_at_judging == [False]  # free_gpu_memory collects first

"""The protocol's parts without an engine: flags and presets, prompts, tuning choice, Nsight and inflate."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.reproduce import profiling
from bench.reproduce.arms import baseline_arms, tuning_grid
from bench.reproduce.draft_steps import DraftStep, take_draft_steps
from bench.reproduce.cli import config_from, parser
from bench.reproduce.inflate import inflate_command, inflate_pair, inflated_dir
from bench.reproduce.presets import FULL, SMOKE
from bench.reproduce.prompts import Dataset, cut_to_context, load_datasets, prompts_at
from bench.reproduce.protocol import cases_of, fingerprint_defaults, model_settings
from bench.reproduce.runs import PauseMeter, RunRecord
from bench.reproduce.tuning import (
    FINAL_TIE, CandidateScore, finalists, score_candidates, score_finalists, tuned_profile, write_tuned_profile,
)
from draft_service.options import DraftOptions
from draft_service.tuned_profile import load_tuned_profile
from gateway.request import GenerationStats


def config(*argv: str):
    return config_from(parser().parse_args(list(argv)))


def test_flags_replace_preset_fields_and_the_rest_stays():
    full = config("--preset", "full")
    assert full == FULL and full.context_targets == (4096, 16384, 32768, 65536, 131072) and full.prompts >= 8
    custom = config("--preset", "custom", "--context-targets", "2048", "8192", "--policies", "online", "full",
                    "--candidate-configs", "16:0.0:4", "--prompts", "3", "--temperature", "0.7", "--seed", "5",
                    "--base-model", "/m/t", "--draft-model", "/m/d", "--inflate-8b", "--reference-prompts", "0")
    assert custom.preset == "custom"  # named so in its report and its folder, though it starts from smoke's values
    assert custom.context_targets == (2048, 8192) and custom.policies == ("online", "full")
    assert custom.candidate_configs == ("16:0.0:4",) and custom.prompts == 3
    assert (custom.temperature, custom.seed, custom.inflate_8b) == (0.7, 5, True)
    assert (custom.base_model, custom.draft_model) == (Path("/m/t"), Path("/m/d"))
    assert custom.eval_max_new_tokens == SMOKE.eval_max_new_tokens
    assert (custom.reference_prompts, SMOKE.reference_prompts, FULL.reference_prompts) == (0, 2, 2)


def test_the_full_preset_has_a_final_round_and_a_run_recorded_without_one_had_none():
    assert (FULL.tune_finalists, SMOKE.tune_finalists, fingerprint_defaults()["tune_finalists"]) == (3, 0, 0)
    assert config("--preset", "full", "--tune-finalists", "0").tune_finalists == 0


def test_the_full_preset_compares_contexts_on_the_same_texts_and_a_run_recorded_before_did_not():
    assert (FULL.same_prompts, SMOKE.same_prompts, fingerprint_defaults()["same_prompts"]) == (True, False, False)
    assert config("--preset", "full", "--same-prompts", "off").same_prompts is False


def test_the_working_set_is_a_tuning_dimension_of_the_full_preset():
    assert FULL.salience_candidates == (True, False) and SMOKE.salience_candidates == (True,)
    assert config("--preset", "custom", "--salience-candidates", "off", "on").salience_candidates == (False, True)
    with pytest.raises(SystemExit):
        config("--preset", "custom", "--salience-candidates", "sometimes")
    grid = tuning_grid(["full"], ["16:0.0:4", "64:0.0:8"], (True, False))
    assert [arm.label for arm in grid] == [
        "diffspec[full 16:0.0:4]", "diffspec[full 64:0.0:8]",
        "diffspec[full 16:0.0:4, whole context]", "diffspec[full 64:0.0:8, whole context]",
    ]
    assert [arm.draft.salience for arm in grid] == [True, True, False, False]
    # the whole-context candidate of the baseline tree drafts as the eagle3 arm does
    assert grid[3].draft == baseline_arms()["eagle3"].draft


def test_a_context_may_tune_on_more_prompts_and_a_run_recorded_before_tuned_on_tune_prompts_everywhere():
    given = config("--preset", "full", "--tune-prompts", "4", "--tune-prompts-at", "4096=8", "16384=6")
    assert given.tune_prompts_at == ("4096=8", "16384=6")
    assert [given.tune_prompts_for(c) for c in (4096, 16384, 65536)] == [8, 6, 4]
    assert FULL.tune_prompts_at == () and fingerprint_defaults()["tune_prompts_at"] == []


@pytest.mark.parametrize("bad", [["--candidate-configs", "64:0.0"], ["--policies", "sideways"],
                                 ["--tune-finalists", "-1"], ["--tune-prompts-at", "4096"],
                                 ["--tune-prompts-at", "4096=0"], ["--tune-prompts-at", "4096=two"],
                                 ["--tune-prompts-at", "4096=8", "4096=6"], ["--tune-prompts-at", "1234=8"]])
def test_a_bad_grid_is_refused_before_anything_loads(bad):
    with pytest.raises(SystemExit):
        from bench.reproduce.cli import main

        main(["--preset", "custom", *bad])


def test_models_default_to_the_settings_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_BASE_MODEL", str(tmp_path / "llama"))
    monkeypatch.setenv("DIFFSPEC_DRAFT_MODEL", str(tmp_path / "eagle"))
    settings = model_settings(config("--preset", "smoke"))
    assert (settings.base_model, settings.draft_model) == (tmp_path / "llama", tmp_path / "eagle")
    flagged = model_settings(config("--preset", "smoke", "--base-model", str(tmp_path / "other")))
    assert (flagged.base_model, flagged.draft_model) == (tmp_path / "other", tmp_path / "eagle")


def test_jsonl_and_plain_files_become_datasets(tmp_path):
    jsonl = tmp_path / "two.jsonl"
    jsonl.write_text(json.dumps({"text": "ab"}) + "\n" + json.dumps({"text": "abcd"}) + "\n")
    plain = tmp_path / "one.py"
    plain.write_text("xyz")
    datasets = load_datasets([jsonl, plain], lambda text: [0] + [ord(c) for c in text])
    assert [(d.name, d.prompt_ids) for d in datasets] == [
        ("two", [[0, 97, 98], [0, 97, 98, 99, 100]]), ("one", [[0, 120, 121, 122]])]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="no 'text'"):
        load_datasets([bad], list)


def test_prompts_keep_bos_and_their_end_and_skip_short_ones():
    assert cut_to_context([0, 1, 2, 3, 4, 5], 3) == [0, 4, 5]
    dataset = Dataset("d", [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1], [0, 5, 6, 7]])
    assert prompts_at(dataset, 4, 0, 5) == [(1, [0, 2, 3, 4]), (3, [0, 5, 6, 7])]
    assert prompts_at(dataset, 4, 2, 1) == [(3, [0, 5, 6, 7])]
    assert prompts_at(dataset, 9, 0, 2) == []
    assert prompts_at(dataset, 2, 0, 5, long_enough_for=4) == [(1, [0, 4]), (3, [0, 7])]  # the texts that fill 4


@pytest.mark.parametrize(("same", "indices"), [(True, {2: [1, 3], 4: [1, 3]}), (False, {2: [0, 1], 4: [1, 3]})])
def test_contexts_take_the_texts_of_the_longest_with_same_prompts(same, indices):
    """On, every context evaluates the prompts that fill the longest context some prompt fills (8 here: none
    fills it, and it is skipped), and tunes on the next one; off, each context the first prompts that fill it."""
    dataset = Dataset("d", [[0, 1, 2], [0, 1, 2, 3, 4], [0, 1], [0, 5, 6, 7], [0, 8, 9, 10, 11]])
    config = replace(SMOKE, context_targets=(2, 4, 8), prompts=2, tune_prompts=1, tune_max_new_tokens=1,
                     eval_max_new_tokens=1, same_prompts=same)  # fmt: skip
    cases = cases_of(config, [dataset], contexts=[2, 4], max_context=10_000)
    assert {case.context: [i for i, _ in case.eval_prompts] for case in cases} == indices
    tuned = {2: [4], 4: [4]} if same else {2: [2], 4: [4]}
    assert {case.context: [i for i, _ in case.tune_prompts] for case in cases} == tuned
    assert all(len(ids) == case.context for case in cases for _, ids in case.eval_prompts + case.tune_prompts)


def test_more_tuning_prompts_at_a_short_context_come_from_texts_that_fill_it():
    """With same_prompts, a context's tuning prompts are the texts long enough for the longest context first;
    past them, other texts that fill this context, each in index order. A context left at tune_prompts keeps
    the texts every context tunes on."""
    dataset = Dataset("d", [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8],
                            [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1]])  # fmt: skip
    config = replace(SMOKE, context_targets=(4, 8), prompts=1, tune_prompts=1, tune_max_new_tokens=1,
                     eval_max_new_tokens=1, same_prompts=True, tune_prompts_at=("4=3",))  # fmt: skip
    cases = cases_of(config, [dataset], contexts=[4, 8], max_context=10_000)
    assert {case.context: [i for i, _ in case.eval_prompts] for case in cases} == {4: [0], 8: [0]}
    # prompts 3 and 5 fill 8 and come first; then 2 fills 4 (1 and 6 are too short, 4 is not needed)
    assert {case.context: [i for i, _ in case.tune_prompts] for case in cases} == {4: [3, 5, 2], 8: [3]}
    assert all(len(ids) == case.context for case in cases for _, ids in case.tune_prompts)


def _run(
    label: str, new_tokens: int, decode_seconds: float, steps: int, accepted: int,
    draft_steps: list[DraftStep] | None = None,
) -> RunRecord:  # fmt: skip
    stats = GenerationStats(new_tokens=new_tokens, decode_seconds=decode_seconds, steps=steps, accepted_drafts=accepted)
    return RunRecord("tune", "d", 64, 0, "diffspec", label, [], stats, 1.0, 0.1, None, draft_steps=draft_steps or [])


def test_tuning_chooses_the_fastest_decode_not_the_highest_tau():
    grid = tuning_grid(["online", "full"], ["32:0.0:6", "64:0.0:8"])
    assert [a.label for a in grid] == ["diffspec[online 32:0.0:6]", "diffspec[online 64:0.0:8]",
                                      "diffspec[full 32:0.0:6]", "diffspec[full 64:0.0:8]"]
    runs = [_run(grid[0].label, 33, 1.0, 10, 20), _run(grid[1].label, 33, 0.5, 5, 25),  # 32 and 64 tok/s
            _run(grid[2].label, 33, 0.8, 4, 30), _run(grid[3].label, 33, 2.0, 4, 30)]  # 40 and 16 tok/s
    scores = score_candidates(grid, runs)
    assert [s.chosen for s in scores] == [False, True, False, False]
    assert [s.decode_tokens_per_s for s in scores] == [32.0, 64.0, 40.0, 16.0]
    assert [s.tau for s in scores] == [3.0, 6.0, 8.5, 8.5]
    assert (scores[1].policy, scores[1].tree_config) == ("online", "64:0.0:8")


def test_the_final_round_scores_only_finalists_and_chooses_among_them():
    grid = tuning_grid(["online"], ["16:0.0:4", "32:0.0:6", "64:0.0:8"])
    first = score_candidates(grid, [_run(grid[0].label, 33, 0.5, 4, 8), _run(grid[1].label, 33, 1.0, 4, 8),
                                    _run(grid[2].label, 33, 0.5, 4, 8)])  # 64, 32 and 64 tok/s
    assert [s.chosen for s in first] == [True, False, False]  # the first listed wins a tie
    shortlist = finalists(grid, first, 2)
    assert shortlist == [grid[0], grid[2]] and finalists(grid, first, 5) == grid and finalists(grid, first, 0) == []
    final = score_finalists(first, [_run(grid[0].label, 129, 4.0, 40, 88), _run(grid[2].label, 129, 2.0, 20, 108)])
    assert [(s.final_tau, s.final_decode_tokens_per_s, s.chosen) for s in final] == [
        (3.2, 32.0, False), (None, None, False), (6.4, 64.0, True)]
    assert [(s.tau, s.decode_tokens_per_s) for s in final] == [(s.tau, s.decode_tokens_per_s) for s in first]


@pytest.mark.parametrize(
    ("decode_seconds", "tree_tokens", "chosen"),
    [
        ((2.0, 2.05), (64, 32), [False, True]),  # 64 and 62.4 tok/s: tied, the fewer tree tokens a token wins
        ((2.0, 2.10), (64, 32), [True, False]),  # 64 and 61.0 tok/s: 4.8% apart, the faster wins
        ((2.05, 2.0), (64, 32), [False, True]),  # the faster also verifies fewer
        ((2.0, 2.0), (32, 32), [True, False]),  # tied in both: the first listed
    ],
)
def test_finalists_within_the_tie_margin_go_to_the_fewest_tree_tokens_a_token(decode_seconds, tree_tokens, chosen):
    grid = tuning_grid(["full"], ["32:0.0:6", "64:0.0:8"])
    first = score_candidates(grid, [_run(arm.label, 33, 1.0, 4, 8) for arm in grid])
    # 20 steps of 3 accepted drafts each, every tree of ``tokens`` nodes: 4 tokens emitted a step
    finals = [
        _run(arm.label, 129, seconds, 20, 60, [DraftStep(3, 6, tokens, [0, 0, 0], 1)] * 20)
        for arm, seconds, tokens in zip(grid, decode_seconds, tree_tokens)
    ]
    final = score_finalists(first, finals)
    assert [s.chosen for s in final] == chosen
    assert [s.final_tree_tokens_per_token for s in final] == [tokens / 4 for tokens in tree_tokens]
    assert FINAL_TIE == 0.03


def _score(dataset: str, context: int, policy: str, config: str, tokens_per_s: float, chosen: bool,
           final_tokens_per_s: float | None = None) -> CandidateScore:
    return CandidateScore(dataset, context, f"diffspec[{policy} {config}]", policy, config, True, 2, 3.0, tokens_per_s,
                          final_decode_tokens_per_s=final_tokens_per_s, chosen=chosen)


def test_the_tuned_profile_keeps_each_case_winner_and_pools_datasets_per_context(tmp_path):
    scores = [
        _score("code", 4096, "online", "32:0.0:6", 100.0, False),
        _score("code", 4096, "online", "64:0.0:8", 110.0, True),
        _score("prose", 4096, "online", "32:0.0:6", 60.0, True),
        _score("prose", 4096, "online", "64:0.0:8", 50.0, False),
        _score("code", 65536, "full", "16:0.0:4", 40.0, True), _score("code", 65536, "full", "32:0.0:6", 30.0, False),
    ]
    profile = tuned_profile(scores, {"command": "python -m bench.reproduce --preset full"})
    assert {name: [(e["context"], e["tree_config"]) for e in rows] for name, rows in profile["datasets"].items()} == {
        "code": [(4096, "64:0.0:8"), (65536, "16:0.0:4")], "prose": [(4096, "32:0.0:6")]}
    # at 4K: 32:0.0:6 is 100/110 and 60/60 of each dataset's best (geometric mean .953), 64:0.0:8 1 and 50/60 (.913)
    assert [(e["context"], e["policy"], e["tree_config"]) for e in profile["default"]] == [
        (4096, "online", "32:0.0:6"), (65536, "full", "16:0.0:4")]
    loaded = load_tuned_profile(write_tuned_profile(tmp_path, scores, {}))
    assert loaded.options_for(3000) == DraftOptions("online", "32:0.0:6", True)
    assert loaded.options_for(70000) == DraftOptions("full", "16:0.0:4", True)


def test_the_tuned_profile_ranks_finalists_by_their_final_round():
    scores = [
        _score("code", 4096, "online", "32:0.0:6", 100.0, False, 60.0),
        _score("code", 4096, "online", "64:0.0:8", 95.0, True, 70.0),
        _score("code", 4096, "online", "16:0.0:4", 90.0, False),
    ]
    profile = tuned_profile(scores, {})
    assert [e["tree_config"] for e in profile["datasets"]["code"]] == ["64:0.0:8"]
    assert [e["tree_config"] for e in profile["default"]] == ["64:0.0:8"]  # one dataset: the chosen one


def test_draft_steps_come_only_from_a_recording_engine():
    class Recording:
        def take_draft_steps(self) -> list[DraftStep]:
            return [DraftStep(2, 3, 9, [0, 1], 2)]

    assert take_draft_steps(object()) == []  # bench.paired's engine records none
    assert take_draft_steps(Recording()) == [DraftStep(2, 3, 9, [0, 1], 2)]
    assert DraftStep.from_list(DraftStep(2, 3, 9, [0, 1], 2).to_list()) == DraftStep(2, 3, 9, [0, 1], 2)


def test_nsys_missing_says_so_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert profiling.run_under_nsys(["--preset", "smoke", "--nsys"], SMOKE) == 2
    assert "no `nsys` on PATH" in capsys.readouterr().err


def test_nsys_command_wraps_the_same_run_into_its_folder():
    command = profiling.nsys_command(["--preset", "smoke", "--nsys", "--prompts", "2"], SMOKE, "/opt/nsys")
    assert command[:2] == ["/opt/nsys", "profile"] and "--capture-range=cudaProfilerApi" in command
    inner = command[command.index("bench.reproduce") + 1:]
    out_dir = Path(inner[inner.index("--out-dir") + 1])
    assert out_dir.parent == Path("results") and out_dir.name.startswith("smoke_")
    assert f"--output={out_dir / 'nsys_profile'}" in command
    assert "--nsys" not in inner and inner[-1] == "--profile-window" and inner[:4] == ["--preset", "smoke", "--prompts", "2"]


def test_inflate_calls_the_shared_tool(tmp_path):
    command = inflate_command(tmp_path, Path("/m/bench-code"), Path("/m/head"), Path("/tmp/b8"))
    assert command[1:] == [str(tmp_path / "tools" / "inflate.py"), "--target", "/m/bench-code", "--head", "/m/head",
                           "--out", "/tmp/b8"]
    with pytest.raises(SystemExit, match="tools/inflate.py"):
        inflate_pair(tmp_path, Path("/m/bench-code"), Path("/m/head"))


def test_each_head_gets_its_own_inflated_pair():
    target = Path("/m/bench-code")
    short, long = inflated_dir(target, Path("/m/head")), inflated_dir(target, Path("/r/head"))
    assert short != long and short.name.startswith("diffspec-8b-bench-code-")
    assert inflated_dir(target, Path("/m/head")) == short


def test_the_pause_meter_times_the_collections_inside_it_and_no_others():
    import gc

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    with PauseMeter() as pauses:
        for _ in range(20000):
            Cycle()
        gc.collect()
    measured = pauses.gc_seconds
    assert measured > 0.0
    gc.collect()  # after the meter: not counted
    assert pauses.gc_seconds == measured
    assert pauses.allocator_retries == 0  # no CUDA allocation retried (none on a CPU)

"""A stopped reproduce run resumes from its folder: the recorded runs are reused, only the rest generate,
and the results are those of one uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.reproduce.checkpoint import PROTOCOL_FILE, RUNS_FILE, VERDICTS_FILE
from bench.reproduce.cli import main
from bench.reproduce.exactness import Divergence
from bench.reproduce.judging import Judge, JudgingLimit
from bench.reproduce.protocol import BesideAuto, shortest_prompts_first
from bench.reproduce.runs import RunRecord
from gateway.request import GenerationStats
from tests.bench.conftest import forbid, stopped_copy

KEPT_RUNS = 4  # of the smoke run's 7: its tuning pass and Auto's and one baseline's evaluation


def _argv(code_prompts: Path, out_dir: Path, eval_tokens: int = 16) -> list[str]:
    """The smoke run's flags (tests/bench/conftest.py), into ``out_dir``."""
    return ["--preset", "smoke", "--data-files", str(code_prompts), "--context-targets", "1024",
            "--tune-max-new-tokens", "8", "--eval-max-new-tokens", str(eval_tokens), "--warmup-tokens", "4",
            "--out-dir", str(out_dir)]


def _runs(results: dict) -> list[tuple]:
    return [(r["phase"], r["prompt"], r["label"], r["token_ids"]) for r in results["runs"]]


def test_a_resumed_run_generates_only_what_is_missing_and_ends_as_one_run(smoke_run, code_prompts, tmp_path):
    _, smoke_dir, whole = smoke_run
    recorded = (smoke_dir / RUNS_FILE).read_text().splitlines()
    assert len(recorded) == len(whole["runs"]) == 7
    stopped = stopped_copy(smoke_dir, tmp_path / "stopped")
    (stopped / RUNS_FILE).write_text("".join(line + "\n" for line in recorded[:KEPT_RUNS]))

    assert main([*_argv(code_prompts, stopped), "--resume"]) == 0
    resumed = json.loads((stopped / "results.json").read_text())
    lines = (stopped / RUNS_FILE).read_text().splitlines()
    assert lines[:KEPT_RUNS] == recorded[:KEPT_RUNS] and len(lines) == len(recorded)  # only the 3 missing ran
    assert _runs(resumed) == _runs(whole)  # greedy fp32: the same tokens, the same order
    reused = [r["request_seconds"] for r in resumed["runs"][:KEPT_RUNS]]
    assert reused == [r["request_seconds"] for r in whole["runs"][:KEPT_RUNS]]  # reused, not re-timed
    assert resumed["exactness"]["passed"] and [s["arm"] for s in resumed["summaries"]] == [
        s["arm"] for s in whole["summaries"]]


def test_resuming_under_other_flags_or_without_a_folder_is_refused(smoke_run, code_prompts, tmp_path, capsys):
    _, smoke_dir, _ = smoke_run
    stopped = tmp_path / "stopped"
    shutil.copytree(smoke_dir, stopped)
    with pytest.raises(SystemExit, match="was run with other settings \\(eval_max_new_tokens\\)"):
        main([*_argv(code_prompts, stopped, eval_tokens=12), "--resume"])
    with pytest.raises(SystemExit, match="holds no earlier run"):
        main([*_argv(code_prompts, tmp_path / "empty"), "--resume"])
    with pytest.raises(SystemExit):
        main(["--preset", "smoke", "--resume"])
    assert "--resume needs --out-dir" in capsys.readouterr().err


def test_a_resumed_run_with_every_run_recorded_only_judges(smoke_run, code_prompts, tmp_path, monkeypatch):
    """Nothing left to generate: no warm-up runs, the results are the recorded ones."""
    _, smoke_dir, whole = smoke_run
    finished = stopped_copy(smoke_dir, tmp_path / "finished")
    forbid(monkeypatch, ("warm_up_target", "warm_up_draft", "warm_up_draft_over", "warm_up_generations"),
           "a resumed run with nothing left warmed up")
    assert main([*_argv(code_prompts, finished), "--resume"]) == 0
    resumed = json.loads((finished / "results.json").read_text())
    assert _runs(resumed) == _runs(whole) and resumed["exactness"]["passed"]


def test_recorded_verdicts_are_reused_and_missing_ones_judged(smoke_run, code_prompts, tmp_path):
    """A judging stopped part-way resumes: each recorded verdict is taken as written, the rest are judged."""
    _, smoke_dir, whole = smoke_run
    judged = (smoke_dir / VERDICTS_FILE).read_text().splitlines()
    assert len(judged) == sum(r["phase"] == "eval" and r["arm"] != "auto" for r in whole["runs"])
    first = json.loads(judged[0])
    first["exactness"]["reason"] = "recorded by an earlier process"
    stopped = tmp_path / "stopped"
    shutil.copytree(smoke_dir, stopped)
    (stopped / VERDICTS_FILE).write_text(json.dumps(first) + "\n")

    assert main([*_argv(code_prompts, stopped), "--resume"]) == 0
    resumed = json.loads((stopped / "results.json").read_text())
    reasons = {(r["phase"], r["prompt"], r["label"]): r["exactness"]["reason"] for r in resumed["runs"] if r["exactness"]}
    phase, _dataset, _context, prompt, label = first["run"]
    assert reasons.pop((phase, prompt, label)) == "recorded by an earlier process"
    assert reasons and all(reason == "same tokens as Auto" for reason in reasons.values())
    assert len((stopped / VERDICTS_FILE).read_text().splitlines()) == len(judged)  # the rest judged and recorded


@pytest.mark.parametrize(("field", "other"), [
    ("salience_candidates", ["--salience-candidates", "on", "off"]),  # before the working set was tuned over
    ("tune_finalists", ["--tune-finalists", "2"]),  # before the tuning pass had a final round
])
def test_a_run_recorded_before_a_protocol_field_existed_resumes_at_its_default(
    smoke_run, code_prompts, tmp_path, field, other
):
    _, smoke_dir, whole = smoke_run
    older = tmp_path / "older"
    shutil.copytree(smoke_dir, older)
    recorded = json.loads((older / PROTOCOL_FILE).read_text())
    del recorded[field]
    (older / PROTOCOL_FILE).write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match=f"other settings \\({field}\\)"):
        main([*_argv(code_prompts, older), *other, "--resume"])
    assert main([*_argv(code_prompts, older), "--resume"]) == 0
    assert _runs(json.loads((older / "results.json").read_text())) == _runs(whole)


def test_a_run_recorded_before_a_setting_existed_resumes_at_its_default(smoke_run, code_prompts, tmp_path, monkeypatch):
    _, smoke_dir, _ = smoke_run
    older = tmp_path / "older"
    shutil.copytree(smoke_dir, older)
    recorded = json.loads((older / PROTOCOL_FILE).read_text())
    del recorded["settings"]["salience_min_overlap"]  # as a run recorded before the setting existed
    (older / PROTOCOL_FILE).write_text(json.dumps(recorded))
    monkeypatch.setenv("DIFFSPEC_SALIENCE_MIN_OVERLAP", "0.5")
    with pytest.raises(SystemExit, match="other settings \\(settings\\)"):
        main([*_argv(code_prompts, older), "--resume"])
    monkeypatch.delenv("DIFFSPEC_SALIENCE_MIN_OVERLAP")
    assert main([*_argv(code_prompts, older), "--resume"]) == 0


def test_the_fp32_runs_attention_is_a_judging_choice_that_a_resumed_run_may_change(
    smoke_run, code_prompts, tmp_path, monkeypatch
):
    """``--fp32-attention-backend`` sets the rule's fp32 engine's attention alone: not part of what the run
    measures, so a run resumes under another one, and the serving settings keep theirs."""
    import bench.reproduce.protocol as protocol

    _, smoke_dir, _ = smoke_run
    resumed = stopped_copy(smoke_dir, tmp_path / "resumed")
    built = []

    class RecordingRerun(protocol.Fp32Rerun):
        def __init__(self, settings, *args, **kwargs):
            built.append(settings.attention_backend)
            super().__init__(settings, *args, **kwargs)

    monkeypatch.setattr(protocol, "Fp32Rerun", RecordingRerun)
    assert main([*_argv(code_prompts, resumed), "--resume", "--fp32-attention-backend", "torch"]) == 0
    assert built == ["torch"]
    assert main([*_argv(code_prompts, resumed), "--resume"]) == 0  # without the flag: the serving settings' own
    assert built == ["torch", "auto"]
    assert json.loads((resumed / PROTOCOL_FILE).read_text())["settings"]["attention_backend"] == "auto"


def _planted_divergence(smoke_dir: Path, to: Path, position: int) -> tuple[Path, dict, list[dict]]:
    """The smoke run stopped before its judging (no verdicts, no results), its ``eagle3`` evaluation's token at
    ``position`` changed: the folder, that run, and every recorded run."""
    stopped = stopped_copy(smoke_dir, to)
    (stopped / VERDICTS_FILE).write_text("")
    runs = [json.loads(line) for line in (stopped / RUNS_FILE).read_text().splitlines()]
    planted = next(r for r in runs if r["phase"] == "eval" and r["arm"] == "eagle3")
    planted["token_ids"][position] = (planted["token_ids"][position] + 1) % 8192
    (stopped / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in runs))
    return stopped, planted, runs


def test_past_the_judging_limit_a_divergence_is_left_unchecked_and_a_later_resume_judges_it(
    smoke_run, code_prompts, tmp_path, monkeypatch
):
    """``--judge-minutes 0``: a divergence is neither judged nor recorded; the report says so and does not pass.
    Runs equal to Auto's are still exact. Resumed without the limit, the divergence is judged."""
    stopped, planted, _ = _planted_divergence(smoke_run[1], tmp_path / "stopped", position=3)

    def no_evidence(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a divergence was judged past the judging limit")

    monkeypatch.setattr(Judge, "_greedy_evidence", no_evidence)

    assert main([*_argv(code_prompts, stopped), "--resume", "--judge-minutes", "0"]) == 0
    limited = json.loads((stopped / "results.json").read_text())
    verdicts = {r["label"]: r["exactness"] for r in limited["runs"] if r["phase"] == "eval" and r["arm"] != "auto"}
    unchecked = verdicts.pop(planted["label"])
    assert unchecked["verdict"] == "unchecked" and unchecked["divergence"]["position"] == 3
    assert {v["verdict"] for v in verdicts.values()} == {"exact"}
    assert limited["exactness"]["unchecked"] == 1 and not limited["exactness"]["passed"]
    assert "(1 unchecked)" in (stopped / "results.md").read_text()
    recorded = [json.loads(line)["run"][-1] for line in (stopped / VERDICTS_FILE).read_text().splitlines()]
    assert planted["label"] not in recorded and len(recorded) == len(verdicts)

    monkeypatch.undo()
    assert main([*_argv(code_prompts, stopped), "--resume"]) == 1  # the planted token: a mismatch
    judged = json.loads((stopped / "results.json").read_text())
    assert next(r for r in judged["runs"] if r["label"] == planted["label"] and r["phase"] == "eval")[
        "exactness"]["verdict"] == "mismatch"


def test_the_report_is_written_before_the_judging_so_a_machine_lost_during_it_leaves_the_tables(
    smoke_run, code_prompts, tmp_path, monkeypatch
):
    """A divergence to replay: the report is written first, the divergence not judged yet, and stays when the
    judging dies (the lent machine went away)."""
    stopped, planted, runs = _planted_divergence(smoke_run[1], tmp_path / "stopped", position=5)

    class MachineGone(Exception):
        pass

    def gone(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise MachineGone

    monkeypatch.setattr(Judge, "_greedy_evidence", gone)
    with pytest.raises(MachineGone):
        main([*_argv(code_prompts, stopped), "--resume"])
    written = json.loads((stopped / "results.json").read_text())
    verdicts = {r["label"]: r["exactness"] for r in written["runs"] if r["phase"] == "eval" and r["arm"] != "auto"}
    waiting = verdicts.pop(planted["label"])
    assert waiting["verdict"] == "unchecked" and "not judged yet" in waiting["reason"]
    assert waiting["divergence"]["position"] == 5
    assert {v["verdict"] for v in verdicts.values()} == {"exact"} and not written["exactness"]["passed"]
    assert "(1 unchecked)" in (stopped / "results.md").read_text()
    assert len(written["summaries"]) == len({(r["context"], r["label"]) for r in runs if r["phase"] == "eval"})


def test_the_judging_limit_counts_from_its_start():
    now = [100.0]
    limit = JudgingLimit(0.5, clock=lambda: now[0])
    assert not limit.reached()
    now[0] += 29.9
    assert not limit.reached()
    now[0] += 0.1
    assert limit.reached()
    assert not JudgingLimit(None, clock=lambda: 1e12).reached()
    verdict = limit.unchecked(Divergence(7, 1, 2))
    assert (verdict.verdict, verdict.divergence, limit.left_unchecked) == ("unchecked", Divergence(7, 1, 2), 1)


def test_the_judging_takes_the_shortest_prompts_first_each_lengths_runs_in_order():
    stats = GenerationStats(new_tokens=3, steps=2)

    def beside_auto(context: int, prompt: int, label: str) -> BesideAuto:
        run = RunRecord("eval", "d", context, prompt, "diffspec", label, [], stats, 1.0, 0.1, None)
        return BesideAuto(run, run, Divergence(1, 2, 3))

    prompt_ids = {("d", 65536, 2): [0] * 65536, ("d", 4096, 2): [0] * 4096, ("d", 16384, 7): [0] * 16384,
                  ("d", 16384, 2): [0] * 16384}  # fmt: skip
    judged = [beside_auto(65536, 2, "a"), beside_auto(16384, 7, "b"), beside_auto(4096, 2, "c"),
              beside_auto(16384, 2, "d"), beside_auto(65536, 2, "e")]  # fmt: skip
    order = [(b.run.context, b.run.label) for b in shortest_prompts_first(judged, prompt_ids)]
    assert order == [(4096, "c"), (16384, "b"), (16384, "d"), (65536, "a"), (65536, "e")]

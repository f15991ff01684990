"""The tuning pass's final round (``tune_finalists``): the first pass's fastest candidates run again with the
evaluation's tokens and the choice follows them; on a fake engine whose decode rates are set per tree and
length, then end to end on the tiny pair (the bar's count, the report, a resumed run)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from operator import itemgetter
from pathlib import Path
from typing import AsyncIterator

import pytest
from tqdm import tqdm

from bench import branch_policy_analysis
from bench.reproduce import protocol
from bench.reproduce.checkpoint import RUNS_FILE, RunCheckpoint
from bench.reproduce.cli import main
from bench.reproduce.presets import SMOKE
from bench.reproduce.protocol import Case, _Protocol
from bench.reproduce.report import markdown
from bench.reproduce.tuning import FINAL_TIE
from diffspec.settings import DiffSpecSettings
from gateway.request import GenerationChunk, GenerationRequest, GenerationStats
from tests.bench.conftest import forbid, stopped_copy

TUNE_TOKENS, EVAL_TOKENS = 8, 16
# decode tokens/s per (tree config, max_new_tokens): the first pass ranks 32 > 48 > 64 > 16, the final round
# of the top three reverses it
RATES = {
    ("16:0.0:4", TUNE_TOKENS): 70.0, ("32:0.0:6", TUNE_TOKENS): 100.0, ("48:0.0:8", TUNE_TOKENS): 90.0,
    ("64:0.0:8", TUNE_TOKENS): 80.0,
    ("32:0.0:6", EVAL_TOKENS): 50.0, ("48:0.0:8", EVAL_TOKENS): 60.0, ("64:0.0:8", EVAL_TOKENS): 75.0,
}
CASE = Case("d", 64, eval_prompts=[(0, [0, 1, 2])], tune_prompts=[(1, [0, 3, 4]), (2, [0, 5, 6])])


class RatedEngine:
    """Emits ``max_new_tokens`` tokens in 4 verification steps at the decode rate ``RATES`` sets for the tree
    (the evaluation's arms at 10 tokens/s)."""

    def __init__(self, stalls: tuple[int, ...] = ()) -> None:
        self.requests: list[tuple[str, int]] = []  # (tree config, max_new_tokens) of the tuning runs, in order
        self.received: list[GenerationRequest] = []  # every request, primes included, in order
        self.stalls = stalls  # indices into ``requests`` whose decode takes 3 times as long

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.received.append(request)
        n, tree = request.max_new_tokens, request.draft.tree_config if request.draft else "auto"
        if (tree, n) in RATES:
            self.requests.append((tree, n))
        rate = RATES.get((tree, n), 10.0) / (3 if len(self.requests) - 1 in self.stalls else 1)
        yield GenerationChunk([7] * n, "", GenerationStats(new_tokens=n, steps=4, accepted_drafts=n - 4,
                                                           decode_seconds=(n - 1) / rate))

    async def target_info(self):  # noqa: ANN201 - never asked: the tests drive the protocol's tuning and evaluation
        raise AssertionError("not called")


def _tuned(out_dir: Path, engine: RatedEngine, resume: bool = False) -> _Protocol:
    config = replace(SMOKE, candidate_configs=tuple(c for c, n in RATES if n == TUNE_TOKENS), tune_prompts=2,
                     tune_max_new_tokens=TUNE_TOKENS, eval_max_new_tokens=EVAL_TOKENS, tune_finalists=3)
    tuned = _Protocol(config, engine, DiffSpecSettings(), out_dir, RunCheckpoint(out_dir, {}, resume))
    asyncio.run(tuned._tune(CASE, tqdm(disable=True)))
    return tuned


def test_the_final_round_runs_the_top_candidates_with_eval_tokens_and_chooses(tmp_path):
    engine = RatedEngine()
    tuned = _tuned(tmp_path, engine)
    first_pass = [(c, TUNE_TOKENS) for c in ("16:0.0:4", "32:0.0:6", "48:0.0:8", "64:0.0:8")]
    finals = [(c, EVAL_TOKENS) for c in ("32:0.0:6", "48:0.0:8", "64:0.0:8")]  # the grid's order, 16:0.0:4 out
    assert engine.requests == first_pass * 2 + finals * 2  # per tuning prompt, every finalist
    assert [(r.phase, r.prompt) for r in tuned.runs] == [("tune", 1)] * 4 + [("tune", 2)] * 4 + [
        ("final", 1)] * 3 + [("final", 2)] * 3
    scores = {s.tree_config: s for s in tuned.scores}
    assert {c: s.decode_tokens_per_s for c, s in scores.items()} == {c: r for (c, n), r in RATES.items()
                                                                     if n == TUNE_TOKENS}
    assert {c: s.final_decode_tokens_per_s for c, s in scores.items()} == {
        "16:0.0:4": None, "32:0.0:6": 50.0, "48:0.0:8": 60.0, "64:0.0:8": 75.0}
    assert (scores["64:0.0:8"].tau, scores["64:0.0:8"].final_tau, scores["16:0.0:4"].final_tau) == (2.0, 4.0, None)
    assert [c for c, s in scores.items() if s.chosen] == ["64:0.0:8"]  # the first pass's third
    assert tuned.chosen[("d", 64)].label == "diffspec[online 64:0.0:8]"  # the evaluated arm
    table = markdown([], tuned.scores, "# r")
    assert ("| candidate | prompts | tau | decode tok/s | final tau | final decode tok/s "
            "| final tree tokens per token | chosen |") in table
    assert "| d | 64 | diffspec[online 16:0.0:4] | 2 | 2.00 | 70.0 | - | - | - |  |" in table
    assert "| d | 64 | diffspec[online 32:0.0:6] | 2 | 2.00 | 100.0 | 4.00 | 50.0 | 0.00 |  |" in table
    assert "| d | 64 | diffspec[online 64:0.0:8] | 2 | 2.00 | 80.0 | 4.00 | 75.0 | 0.00 | **yes** |" in table


def test_each_round_primes_each_tuning_prompt_in_the_tuning_scope_before_its_candidates(tmp_path):
    engine = RatedEngine()
    _tuned(tmp_path, engine)
    primes = [i for i, r in enumerate(engine.received) if r.max_new_tokens == protocol.PRIME_TOKENS]
    assert primes == [0, 5, 10, 14]  # per round (4 candidates, then 3 finalists), per prompt, before its arms
    for i in primes:
        prime, first_arm = engine.received[i], engine.received[i + 1]
        assert prime.prompt_ids == first_arm.prompt_ids and prime.client == first_arm.client == "tuning/d/64"
        assert (prime.draft.policy, first_arm.draft.policy) == ("full", "online")  # no online estimate learns from it
        assert prime.draft.tree_config == first_arm.draft.tree_config  # the first candidate's tree and working set
        assert prime.draft.salience == first_arm.draft.salience


def test_a_stalled_run_is_run_again_once_and_kept_under_its_own_phase(tmp_path):
    engine = RatedEngine(stalls=(8,))  # the final round's first run: 32:0.0:6 on prompt 1
    tuned = _tuned(tmp_path, engine)
    finals = [(c, EVAL_TOKENS) for c in ("32:0.0:6", "48:0.0:8", "64:0.0:8")]
    first_pass = [(c, TUNE_TOKENS) for c in ("16:0.0:4", "32:0.0:6", "48:0.0:8", "64:0.0:8")]
    assert engine.requests == first_pass * 2 + finals * 2 + [finals[0]]  # the stalled one again, after the round
    assert engine.received[-2].max_new_tokens == protocol.PRIME_TOKENS  # its prompt primed again before it
    assert engine.received[-2].prompt_ids == CASE.tune_prompts[0][1]
    stalled = [r for r in tuned.runs if r.phase == "final-stalled"]
    assert [(r.prompt, r.label) for r in stalled] == [(1, "diffspec[online 32:0.0:6]")]
    assert stalled[0].stats.decode_seconds == pytest.approx(3 * (EVAL_TOKENS - 1) / 50.0)
    scores = {s.tree_config: s for s in tuned.scores}
    assert scores["32:0.0:6"].final_decode_tokens_per_s == 50.0  # scored on the run again, not the stalled one
    resumed = _tuned(tmp_path, RatedEngine(), resume=True)  # the record keeps the run again under the phase
    assert resumed.scores == tuned.scores


def test_recorded_tuning_and_final_runs_are_reused_and_a_missing_final_run_is_left(tmp_path):
    first = _tuned(tmp_path, RatedEngine())
    asyncio.run(first._evaluate(CASE, tqdm(disable=True)))
    engine = RatedEngine()
    resumed = _tuned(tmp_path, engine, resume=True)
    assert engine.received == [] and resumed.scores == first.scores  # no prime where every run is recorded
    assert not resumed._has_runs_left(CASE, CASE.context)
    recorded = (tmp_path / RUNS_FILE).read_text().splitlines()
    one_final = ("final", 2, "diffspec[online 48:0.0:8]")
    kept = [line for line in recorded if itemgetter("phase", "prompt", "label")(json.loads(line)) != one_final]
    assert len(kept) == len(recorded) - 1
    (tmp_path / RUNS_FILE).write_text("".join(line + "\n" for line in kept))
    missing = _Protocol(first.config, RatedEngine(), DiffSpecSettings(), tmp_path, RunCheckpoint(tmp_path, {}, True))
    assert missing._has_runs_left(CASE, CASE.context)


def _argv(code_prompts: Path, out_dir: Path) -> list[str]:
    """The smoke run's flags (tests/bench/conftest.py) with three trees, the two fastest as finalists."""
    return ["--preset", "smoke", "--data-files", str(code_prompts), "--context-targets", "1024",
            "--candidate-configs", "16:0.0:4", "32:0.0:6", "64:0.0:8", "--tune-finalists", "2",
            "--tune-max-new-tokens", "8", "--eval-max-new-tokens", "16", "--warmup-tokens", "4",
            "--out-dir", str(out_dir)]


@pytest.fixture(scope="module")
def finals_run(code_prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[tuple[int, int]]]:
    """(output folder, results.json, the bar's (total, count)) of the smoke run with a final round."""
    out_dir = tmp_path_factory.mktemp("results") / "finals"
    bars: list[tuple[int, int]] = []

    class CountingBar(tqdm):
        def __exit__(self, *exc: object) -> None:
            bars.append((self.total, self.n))
            super().__exit__(*exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(protocol, "tqdm", CountingBar)
        assert main(_argv(code_prompts, out_dir)) == 0
    return out_dir, json.loads((out_dir / "results.json").read_text()), bars


def test_the_tiny_pair_runs_the_final_round_and_evaluates_its_choice(finals_run):
    out_dir, result, bars = finals_run
    runs = result["runs"]
    assert [r["phase"] for r in runs] == ["tune"] * 3 + ["final"] * 2 + ["eval"] * 5
    assert bars == [(len(runs), len(runs))]  # the bar's total counts the final round
    scores = result["tuning"]
    shortlist = sorted(scores, key=lambda s: -s["decode_tokens_per_s"])[:2]
    finals = [r for r in runs if r["phase"] == "final"]
    assert {r["label"] for r in finals} == {s["label"] for s in shortlist}
    assert all(r["prompt"] == 1 and len(r["token_ids"]) == 16 for r in finals)  # the tuning prompt, eval tokens
    assert [s["final_decode_tokens_per_s"] is not None for s in scores] == [s in shortlist for s in scores]
    chosen = [s for s in scores if s["chosen"]]
    fastest = max(s["final_decode_tokens_per_s"] for s in shortlist)
    tied = [s for s in shortlist if s["final_decode_tokens_per_s"] >= (1 - FINAL_TIE) * fastest]
    assert len(chosen) == 1 and chosen[0] in tied
    assert chosen[0]["final_tree_tokens_per_token"] == min(s["final_tree_tokens_per_token"] for s in tied)
    assert next(s for s in result["summaries"] if s["arm"] == "diffspec")["label"] == chosen[0]["label"]
    table = (out_dir / "results.md").read_text()
    assert (f"| {chosen[0]['final_tau']:.2f} | {chosen[0]['final_decode_tokens_per_s']:.1f} "
            f"| {chosen[0]['final_tree_tokens_per_token']:.2f} | **yes** |") in table
    rows = branch_policy_analysis.policy_rows(result)
    assert [r.cells[1024].chosen for r in rows] == [s["chosen"] for s in scores]


def test_a_resumed_run_with_its_first_pass_and_final_runs_recorded_only_judges(finals_run, code_prompts, tmp_path,
                                                                               monkeypatch):
    out_dir, whole, _ = finals_run
    finished = stopped_copy(out_dir, tmp_path / "finished")
    forbid(monkeypatch, ("warm_up_generations", "generate_run"), "a resumed run with every run recorded generated")
    assert main([*_argv(code_prompts, finished), "--resume"]) == 0
    assert (finished / RUNS_FILE).read_text() == (out_dir / RUNS_FILE).read_text()
    resumed = json.loads((finished / "results.json").read_text())
    assert resumed["tuning"] == whole["tuning"] and resumed["runs"] == whole["runs"]

"""``online`` against ``full`` at the same start tree, paired by prompt: which runs pair, the mean ratio, and an
interval that tells a real gap from noise."""

from __future__ import annotations

import math
import random

import pytest

from bench.reproduce.policy_pairs import PolicyPairs, policy_pairs
from bench.reproduce.report import markdown
from bench.reproduce.runs import RunRecord
from bench.reproduce.tuning import CandidateScore
from gateway.request import GenerationStats

TREES = ("16:0.0:6", "32:0.0:10")


def _label(policy: str, tree: str, salience: bool) -> str:
    return f"diffspec[{policy} {tree}{'' if salience else ', whole context'}]"


def _scores(context: int = 4096) -> list[CandidateScore]:
    return [CandidateScore("d", context, _label(policy, tree, salience), policy, tree, salience, 4, 4.0, 100.0)
            for policy in ("online", "full") for tree in TREES for salience in (True, False)]  # fmt: skip


def _run(phase: str, label: str, prompt: int, tokens_per_s: float, context: int = 4096) -> RunRecord:
    stats = GenerationStats(new_tokens=129, steps=30, decode_seconds=128 / tokens_per_s)
    return RunRecord(phase, "d", context, prompt, "diffspec", label, [], stats, 1.0, 0.1, None)


def _pairs(speeds: dict[int, tuple[float, float]], phase: str = "tune") -> list[RunRecord]:
    """One online and one full run per prompt at the first tree over the working set."""
    return [_run(phase, _label(policy, TREES[0], True), prompt, speed)
            for prompt, both in speeds.items() for policy, speed in zip(("online", "full"), both)]  # fmt: skip


def test_only_runs_of_one_tree_working_set_prompt_and_round_pair():
    runs = [
        *_pairs({0: (110.0, 100.0)}),  # a pair: ratio 1.1
        _run("tune", _label("online", TREES[0], False), 0, 500.0),  # whole context: its full run is missing
        _run("tune", _label("full", TREES[1], True), 0, 50.0),  # another tree: no online run beside it
        _run("eval", _label("online", TREES[0], True), 0, 500.0),  # the evaluation is not the tuning's
        _run("final", _label("full", TREES[0], True), 0, 80.0),  # the final round pairs only within itself
    ]
    (pairs,) = policy_pairs(runs, _scores())
    assert (pairs.dataset, pairs.context, pairs.pairs) == ("d", 4096, 1)
    assert pairs.ratio == pytest.approx(1.1, rel=1e-3)  # the one pair's ratio; the others changed nothing


def test_contexts_are_separate_and_the_mean_is_geometric():
    runs = _pairs({0: (200.0, 100.0), 1: (50.0, 100.0)})  # x2 and x0.5: even on a log scale
    runs += [_run("tune", _label(p, TREES[0], True), 0, s, 65536) for p, s in (("online", 90.0), ("full", 100.0))]
    by_context = {p.context: p for p in policy_pairs(runs, _scores() + _scores(65536))}
    assert by_context[4096].ratio == pytest.approx(1.0) and by_context[4096].pairs == 2
    assert by_context[65536].ratio == pytest.approx(0.9, rel=1e-3)


def test_a_consistent_gap_is_told_apart_and_noise_around_none_is_not():
    rng = random.Random(1)
    ahead = {i: (100.0 * math.exp(0.05 + rng.gauss(0, 0.02)), 100.0) for i in range(32)}
    noise = {i: (100.0 * math.exp(rng.gauss(0, 0.08)), 100.0) for i in range(32)}
    (told,) = policy_pairs(_pairs(ahead), _scores())
    (untold,) = policy_pairs(_pairs(noise), _scores())
    assert told.verdict == "online ahead" and 1 < told.low < told.ratio < told.high
    assert untold.verdict == "not told apart" and untold.low < 1 < untold.high
    behind = PolicyPairs("d", 4096, 32, 0.95, 0.93, 0.97)
    assert behind.verdict == "online behind"
    assert policy_pairs(_pairs(ahead), _scores()) == [told]  # seeded: the same interval every time


def test_the_report_lists_each_context_s_pairs_under_the_tuning_table():
    pairs = [PolicyPairs("d", 16384, 32, 0.978, 0.952, 1.006)]
    table = markdown([], _scores(), "# r", pairs)
    assert "### `online` against `full` at the same start tree" in table
    assert "| d | 16384 | 32 | 0.978 | 0.952-1.006 | not told apart |" in table
    assert "against `full`" not in markdown([], _scores(), "# r")  # no pairs, no section


def test_an_earlier_run_s_results_give_the_same_pairs_as_its_records(tmp_path, capsys):
    import dataclasses
    import gzip
    import json

    from bench.reproduce.policy_pairs import main, recorded_pairs

    runs = _pairs({0: (120.0, 100.0), 1: (95.0, 100.0), 2: (110.0, 100.0)})
    document = {"tuning": [dataclasses.asdict(s) for s in _scores()], "runs": [r.to_dict() for r in runs]}
    path = tmp_path / "results.json.gz"
    path.write_bytes(gzip.compress(json.dumps(document).encode()))
    (pairs,) = policy_pairs(runs, _scores())
    (recorded,) = recorded_pairs(document)  # from the seconds as results.json rounds them (to the microsecond)
    assert recorded.pairs == 3 and (recorded.ratio, recorded.low, recorded.high) == pytest.approx(
        (pairs.ratio, pairs.low, pairs.high), rel=1e-5)
    assert main([str(path)]) == 0
    assert capsys.readouterr().out == (f"d 4096: 3 pairs, online / full {pairs.ratio:.3f} (95% interval "
                                       f"{pairs.low:.3f}-{pairs.high:.3f}): {pairs.verdict}\n")  # fmt: skip


def test_two_runs_pairs_pool_and_a_prompt_pairs_only_within_its_own_run(tmp_path, capsys):
    import dataclasses
    import json

    from bench.reproduce.policy_pairs import main, recorded_pairs

    def document(speeds: dict[int, tuple[float, float]]) -> dict:
        return {"tuning": [dataclasses.asdict(s) for s in _scores()], "runs": [r.to_dict() for r in _pairs(speeds)]}

    # the same prompts in both runs: pooled, run A's prompt 0 never meets run B's
    first, second = document({0: (200.0, 100.0), 1: (100.0, 100.0)}), document({0: (100.0, 200.0)})
    (pooled,) = recorded_pairs(first, second)
    assert pooled.pairs == 3 and pooled.ratio == pytest.approx(1.0, rel=1e-5)  # x2, x1, x0.5
    (alone,) = recorded_pairs(first)
    assert alone.pairs == 2 and alone.ratio == pytest.approx(2**0.5, rel=1e-5)
    paths = []
    for name, doc in (("a.json", first), ("b.json", second)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(doc))
    assert main([str(p) for p in paths]) == 0
    assert capsys.readouterr().out.startswith("d 4096: 3 pairs, online / full 1.000")

"""The reproduce-run analyses: branch policies across contexts and hazard stability, on a small
hand-made results document (exact figures) and on the shared smoke run's results.json."""

from __future__ import annotations

import json

import pytest

from bench import branch_policy_analysis, hazard_stability_analysis
from bench.reproduce.draft_steps import DraftStep
from bench.hazard_stability_analysis import fixed_widths, pooled_hazard


def _score(context: int, policy: str, config: str, tau: float, tps: float, chosen: bool, salience: bool = True) -> dict:
    return {"dataset": "d", "context": context, "label": f"diffspec[{policy} {config}]", "policy": policy,
            "tree_config": config, "salience": salience, "prompts": 2, "tau": tau, "decode_tokens_per_s": tps,
            "chosen": chosen}


TUNING = [
    _score(4096, "online", "32:0.0:6", 3.0, 80.0, False), _score(4096, "full", "32:0.0:6", 4.0, 100.0, True),
    _score(4096, "full", "32:0.0:6", 4.0, 50.0, False, salience=False),
    _score(16384, "online", "32:0.0:6", 3.5, 90.0, True), _score(16384, "full", "32:0.0:6", 4.0, 45.0, False),
    _score(16384, "full", "32:0.0:6", 4.5, 72.0, False, salience=False),
]


def test_policy_rows_lay_the_tuning_pass_out_by_context(tmp_path):
    rows = branch_policy_analysis.policy_rows({"tuning": TUNING})
    assert [(r.candidate, sorted(r.cells)) for r in rows] == [
        ("online 32:0.0:6", [4096, 16384]), ("full 32:0.0:6", [4096, 16384]),
        ("full 32:0.0:6, whole context", [4096, 16384])]
    online, full, whole = rows
    assert (online.cells[4096].of_best, online.cells[16384].of_best) == (0.8, 1.0)
    assert (full.cells[4096].of_best, full.cells[16384].of_best) == (1.0, 0.5)
    assert (whole.cells[4096].of_best, whole.cells[16384].of_best) == (0.5, 0.8)
    assert [full.cells[4096].chosen, online.cells[16384].chosen] == [True, True]
    table = branch_policy_analysis.markdown(rows, [], "r.json")
    assert "| online 32:0.0:6 | 3.00 / 80.0 (0.80) | **3.50 / 90.0 (1.00)** |" in table
    assert "| full 32:0.0:6 | **4.00 / 100.0 (1.00)** | 4.00 / 45.0 (0.50) |" in table
    assert "| full 32:0.0:6, whole context | 4.00 / 50.0 (0.50) | 4.50 / 72.0 (0.80) |" in table


def test_branch_policy_analysis_of_the_smoke_run(smoke_run, tmp_path):
    _, out_dir, result = smoke_run
    assert branch_policy_analysis.main([str(out_dir / "results.json"), "--out-dir", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"branch_policy.md", "branch_policy.json", "branch_policy_repo_code.png"}
    written = json.loads((tmp_path / "branch_policy.json").read_text())
    assert [(r["policy"], r["tree_config"], r["salience"]) for r in written["rows"]] == [
        (s["policy"], s["tree_config"], s["salience"]) for s in result["tuning"]]
    cells = [r["cells"]["1024"] for r in written["rows"]]
    assert [c["chosen"] for c in cells] == [s["chosen"] for s in result["tuning"]]
    assert max(c["of_best"] for c in cells) == 1.0
    table = (tmp_path / "branch_policy.md").read_text()
    for arm in ("auto", "eagle3", "eagle3+salience", "diffspec", "transformers"):
        assert f"| {arm} | " in table


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # accepted, tree depth, tree tokens, passed ranks, stop width
        ([DraftStep(0, 3, 8, [], 2)], [1.0, None, None]),  # both children at depth 1 failed
        ([DraftStep(1, 3, 8, [0], 1), DraftStep(3, 3, 8, [0, 1, 0], 0)], [0.0, 0.5, 0.0]),  # the second ran off the tree
        ([DraftStep(1, 2, 4, [0], 0)], [0.0, None, None]),  # a leaf at depth 1: censored, depth 2 never tested
    ],
)
def test_pooled_hazard_counts_stops_over_tests(steps, expected):
    assert pooled_hazard(steps, 3) == expected


def test_fixed_widths_follow_the_policy_and_online_has_none():
    assert fixed_widths("eagle3[full 64:0.0:8]") is not None and len(fixed_widths("eagle3[full 64:0.0:8]")) == 8
    assert fixed_widths("chain[chain 64:0.0:8]") == [1] * 8
    assert fixed_widths("diffspec[online 64:0.0:8]") is None and fixed_widths("auto") is None


def test_hazard_replay_reproduces_the_engines_estimates(smoke_run, tmp_path):
    _, out_dir, result = smoke_run
    rows = hazard_stability_analysis.analyse(out_dir / "results.json", tmp_path, depths=4)
    assert {p.name for p in tmp_path.iterdir()} == {
        "hazard_stability.md", "hazard_stability.json", "hazard_over_generation.png", "hazard_across_prompts.png"}
    assert [r.arm for r in rows] == ["eagle3", "eagle3+salience", "diffspec"]
    written = json.loads((tmp_path / "hazard_stability.json").read_text())
    drafting = [r for r in result["runs"] if r["draft_steps"]]
    assert len(written["runs"]) == len(drafting)
    for replayed, run in zip(written["runs"], drafting):
        assert len(replayed["top1"]) == len(run["draft_steps"])
        assert all(0.0 < h < 1.0 for step in replayed["top1"] for h in step)
        if not run["label"].startswith("diffspec[online"):
            # the global prior and the request's profile, replayed in run order, end where the draft's did
            assert replayed["check"] is not None and replayed["check"] <= 1e-4
    for row in rows:
        assert row.prompts == 1 and row.final_std == [0.0] * 4 and row.drift >= 0 and row.settle >= 0

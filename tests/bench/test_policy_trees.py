"""bench.policy_trees: the trees a policy picked per context, from recorded draft steps (a made-up run with
exact figures, and the CPU smoke run)."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest

from bench import policy_trees
from bench.reproduce.checkpoint import RUNS_FILE, load_run_document
from bench.reproduce.draft_steps import DraftStep


def _run(label: str, context: int, steps: list[DraftStep]) -> dict:
    return {"dataset": "d", "context": context, "label": label, "draft_steps": [s.to_list() for s in steps]}


def test_shapes_and_means_per_context(tmp_path):
    document = {"command": "x", "runs": [
        _run("diffspec[online 64:0.0:8]", 4096, [DraftStep(3, 8, 64, [0, 0, 1], 2), DraftStep(8, 8, 64, [0] * 8, 0)]),
        _run("diffspec[online 64:0.0:8]", 4096, [DraftStep(0, 4, 16, [], 10)]),
        _run("diffspec[online 64:0.0:8]", 65536, [DraftStep(1, 4, 16, [0], 3), DraftStep(2, 4, 16, [0, 0], 1)]),
        _run("eagle3[full 64:0.0:8]", 4096, [DraftStep(5, 8, 64, [0] * 5, 3)]),  # another policy: not drawn
        _run("auto", 4096, []),
    ]}
    results = tmp_path / "results.json"
    results.write_text(json.dumps(document))
    rows = policy_trees.analyse(results, tmp_path / "out")
    assert [(r.context, r.runs, r.steps, r.mean_tokens, r.mean_depth, r.tau, r.shapes) for r in rows] == [
        (4096, 2, 3, 48.0, 6.67, 4.667, [(8, 64, 2), (4, 16, 1)]),
        (65536, 1, 2, 16.0, 4.0, 2.5, [(4, 16, 2)]),
    ]
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {"policy_trees.png", "policy_trees.json", "policy_trees.md"}
    assert "| d | 4096 | 2 | 3 | 48.0 | 6.7 | 4.67 | 8x64: 67%, 4x16: 33% |" in (out / "policy_trees.md").read_text()


def test_draws_the_smoke_runs_online_trees(smoke_run, tmp_path):
    _, out_dir, result = smoke_run
    rows = policy_trees.analyse(out_dir / "results.json", tmp_path)
    online = [r for r in result["runs"] if "[online " in r["label"]]
    steps = [DraftStep.from_list(row) for r in online for row in r["draft_steps"]]
    assert len(rows) == 1 and rows[0].context == 1024 and rows[0].runs == len(online)
    assert rows[0].steps == len(steps) == sum(n for _, _, n in rows[0].shapes) > 0
    assert rows[0].mean_tokens == round(sum(s.tree_tokens for s in steps) / len(steps), 2)
    assert (tmp_path / "policy_trees.png").stat().st_size > 10_000


def test_an_unfinished_runs_folder_is_read_from_its_runs_record(smoke_run, tmp_path):
    """Before results.json exists (a run going on, or one whose judging stopped), the folder's runs.jsonl."""
    _, out_dir, _ = smoke_run
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(out_dir / RUNS_FILE, unfinished)
    from_record = policy_trees.analyse(unfinished, tmp_path / "record")
    assert from_record == policy_trees.analyse(out_dir, tmp_path / "results")  # the folder's results.json
    with pytest.raises(SystemExit, match="neither a results.json nor"):
        load_run_document(tmp_path / "record" / "nothing-here")


def test_a_runs_record_kept_compressed_reads_the_same(smoke_run, tmp_path):
    """``bench/results/`` keeps a run's records as ``runs.jsonl.gz``."""
    _, out_dir, _ = smoke_run
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / f"{RUNS_FILE}.gz").write_bytes(gzip.compress((out_dir / RUNS_FILE).read_bytes()))
    assert load_run_document(packed) == load_run_document(out_dir / RUNS_FILE)
    assert policy_trees.analyse(packed, tmp_path / "from_packed") == policy_trees.analyse(out_dir, tmp_path / "plain")

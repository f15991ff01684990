import json

import pytest

from bench.forced_acceptance import summarise
from bench.recent_window_plot import merged_runs, plot, window_lines


def _result(path, runs, chunk_size=64):
    path.write_text(json.dumps({"settings": {"chunk_size": chunk_size}, "runs": runs}))
    return path


def _run(working_set, steps, accepted, prompt=0, context=65536, tree="32:0.0:6"):
    return {"context": context, "working_set": working_set, "tree_config": tree, "prompt": prompt, "steps": steps,
            "accepted": accepted}  # fmt: skip


def test_a_later_file_s_row_replaces_an_earlier_one_s(tmp_path):
    first = _result(tmp_path / "a.json", [_run("2048:256", 10, 30), _run("whole", 10, 20)])
    second = _result(tmp_path / "b.json", [_run("2048:256", 10, 40)])
    rows, chunk_size = merged_runs([first, second])
    assert chunk_size == 64
    assert sorted((r["working_set"], r["accepted"]) for r in rows) == [("2048:256", 40), ("whole", 20)]


def test_files_of_different_chunk_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="chunk sizes differ"):
        merged_runs([_result(tmp_path / "a.json", [], 64), _result(tmp_path / "b.json", [], 32)])


def test_each_budget_and_tree_is_a_line_over_the_windows_the_sets_hold(tmp_path):
    rows = [
        _run("2048:1024", 10, 30), _run("2048:256", 10, 20, prompt=0), _run("2048:256", 10, 10, prompt=1),
        _run("2048:0", 10, 35),  # the default: three quarters, 1,536 tokens
        _run("2048:100", 10, 5),  # whole chunks: one
        _run("4096:2048", 10, 40), _run("whole", 10, 0),
    ]  # fmt: skip
    assert window_lines(summarise(rows), 64) == {
        (65536, 2048, "32:0.0:6"): [(64, 1.5), (256, 2.5), (1024, 4.0), (1536, 4.5)],
        (65536, 4096, "32:0.0:6"): [(2048, 5.0)],
    }
    plot(summarise(rows), 64, tmp_path / "window.png")
    assert (tmp_path / "window.png").stat().st_size > 0

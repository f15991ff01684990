"""The report's tau against the shortest context: only arms that ran the same prompts at every context; the
plots' points in context order."""

from dataclasses import replace

from bench.reproduce.report import ArmSummary, markdown, tau_by_context_lines

BASE = ArmSummary(
    dataset="d", context=4096, arm="eagle3", label="eagle3", prompts=2, prompt_indices=[2, 4], new_tokens=256,
    tau=5.0, decode_tokens_per_s=100.0, decode_speedup=2.0, end_to_end_tokens_per_s=90.0, end_to_end_speedup=1.5,
    prefill_seconds=0.1, first_token_seconds=0.1, draft_ms_per_step=1.0, verify_ms_per_step=5.0,
    host_ms_per_step=0.5, stop_depth_histogram=[], working_set_tokens=0, working_set_updates_per_step=0.0,
    peak_memory_gib=None, exact=2, near_ties=0, mismatches=0, unchecked=0,
)  # fmt: skip


def _at(context, arm, tau, prompts=(2, 4)):
    return replace(BASE, context=context, arm=arm, label=arm, tau=tau, prompt_indices=list(prompts))


def test_each_arm_on_the_same_prompts_gets_its_ratio_to_the_shortest_context():
    summaries = [
        _at(4096, "auto", 1.0), _at(4096, "eagle3", 5.0), _at(4096, "diffspec", 4.0),
        _at(65536, "auto", 1.0), _at(65536, "eagle3", 4.0), _at(65536, "diffspec", 3.8),
    ]  # fmt: skip
    assert tau_by_context_lines(summaries) == [
        "| arm | tau at 4096 | tau at 65536 | 65536 / 4096 |",
        "| --- | --- | --- | --- |",
        "| eagle3 | 5.00 | 4.00 | 0.80 |",
        "| diffspec | 4.00 | 3.80 | 0.95 |",
    ]  # fmt: skip


def test_an_arm_on_other_prompts_or_missing_a_context_gets_no_ratio():
    summaries = [
        _at(4096, "eagle3", 5.0), _at(65536, "eagle3", 4.0, prompts=(5, 6)),  # other texts at 64K
        _at(4096, "diffspec", 4.0),  # not run at 64K
    ]  # fmt: skip
    assert tau_by_context_lines(summaries) == []
    assert tau_by_context_lines([_at(4096, "eagle3", 5.0)]) == []  # one context: nothing to compare


def test_the_report_shows_the_ratios_under_the_dataset_s_table():
    table = markdown([_at(4096, "eagle3", 5.0), _at(16384, "eagle3", 4.5)], [], "# r")
    assert "### d: tau against the shortest context, on the same prompts" in table
    assert "| eagle3 | 5.00 | 4.50 | 0.90 |" in table


def test_a_plot_s_points_go_by_context_whatever_order_the_run_asked_for():
    from bench.reproduce.plots import context_points

    summaries = [_at(16384, "diffspec", 5.0), _at(4096, "diffspec", 5.1), _at(65536, "diffspec", 4.2)]
    assert context_points(summaries, "tau") == [(4096, 5.1), (16384, 5.0), (65536, 4.2)]
    assert context_points([BASE], "peak_memory_gib") == []  # no value (BASE has none), no point

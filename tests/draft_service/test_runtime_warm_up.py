"""The draft's warm-up proposes every tree an online session starts from, and leaves nothing behind."""

from __future__ import annotations

import torch

from draft_service.drafter import KV_ONLY_MIN_ROWS
from draft_service.runtime import DraftRuntime
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import Candidate, SharedMeasurements, TreePlanner
from draft_service.tree_proposal import full_widths
from tests.draft_service.test_drafter import load_head


def projected_rows(monkeypatch, runtime: DraftRuntime) -> list[int]:  # noqa: ANN001
    """The rows of each keys-and-values projection the runtime's head makes from now on."""
    rows, keys_values = [], runtime.head.keys_values

    def counted(token_ids, *args, **kwargs):  # noqa: ANN001, ANN202
        rows.append(len(token_ids))
        return keys_values(token_ids, *args, **kwargs)

    monkeypatch.setattr(runtime.head, "keys_values", counted)
    return rows


def test_warm_up_proposes_each_starting_tree_once_and_keeps_no_session():
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    planner = TreePlanner.start(runtime.candidate_grid[0], SharedMeasurements(), runtime.candidate_grid)
    starting = [*planner.dynamic, *planner.probes, planner.shaped]
    # a probe is as deep as every smaller candidate: past 32:0.0:10 the grid's trees are probed 10 deep
    deepened = {Candidate.dynamic(TreeBudget.parse(config)) for config in ("48:0.0:10", "64:0.0:10")}
    assert set(planner.probes) - set(planner.dynamic) == deepened
    assert runtime.warm_up() == 2 * len(set(starting)) == 20  # over the whole context and with the working set
    assert runtime.sessions == {}
    met = runtime.drafter.proposer.shapes_met  # what a GPU compiled kernels (and recorded graphs) for
    assert len(met) <= 2 * len(set(starting))  # trees of one depth and node bucket share a shape
    budget = runtime.working_set.budget_tokens  # a salience session stages its budget: one capacity for all
    assert {shape.context for shape in met} == {1024, budget}
    assert {shape.depth for shape in met} == {len(c.plan) for c in starting}
    assert all(shape.widths == full_widths(shape.depth) for shape in met)  # every starting tree fits the full tree's


def test_warm_up_projects_a_prompt_chunks_keys_and_values_alone_so_no_request_compiles_it(monkeypatch):
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    rows = projected_rows(monkeypatch, runtime)
    runtime.warm_up()
    assert rows == [KV_ONLY_MIN_ROWS] and runtime.sessions == {}


def test_a_later_warm_up_over_the_whole_context_alone_stages_no_working_set_and_no_long_chunk(monkeypatch):
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    rows = projected_rows(monkeypatch, runtime)
    planner = TreePlanner.start(runtime.candidate_grid[0], SharedMeasurements(), runtime.candidate_grid)
    assert runtime.warm_up(1536, whole_context_only=True) == len({*planner.dynamic, *planner.probes, planner.shaped})
    assert {shape.context for shape in runtime.drafter.proposer.shapes_met} == {1536}
    assert KV_ONLY_MIN_ROWS not in rows and runtime.sessions == {}

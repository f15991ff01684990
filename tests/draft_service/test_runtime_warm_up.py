"""The draft's warm-up proposes every tree an online session starts from, and leaves nothing behind."""

from __future__ import annotations

import torch

from draft_service.runtime import DraftRuntime
from draft_service.tree_plan import SharedMeasurements, TreePlanner
from tests.draft_service.test_drafter import load_head


def test_warm_up_proposes_each_starting_tree_once_and_keeps_no_session():
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    planner = TreePlanner.start(runtime.candidate_grid[0], SharedMeasurements(), runtime.candidate_grid)
    starting = [*planner.dynamic, planner.probe, planner.shaped]
    assert planner.probe in planner.dynamic  # with the default grid, the probe is its largest tree
    assert runtime.warm_up() == len(set(starting)) == 6
    assert runtime.sessions == {}
    met = runtime.drafter.proposer._sightings  # proposal shapes seen: what a GPU compiled kernels for
    assert sum(met.values()) == 6 and set(met.values()) == {1}  # one proposal each, none twice
    trees = {(c.plan, c.budget.total_tokens) for c in starting}
    assert len(met) == len(trees) == 6
    assert {len(shape.widths) for shape in met} == {len(c.plan) for c in starting}

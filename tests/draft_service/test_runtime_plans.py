"""The draft runtime's plans for a batch of online sessions on the bundled head (CPU): the trees it asks the
device proposal for, how often it re-plans, probes and hands verified trees to the planners."""

from __future__ import annotations

import torch

from diffspec.tree import DraftTree

from draft_service.backend import DraftAccept, DraftBatch, DraftStart
from draft_service.options import DraftOptions
from draft_service.runtime import OBSERVED_PER_STEP, REPLAN_EVERY, DraftRuntime
from draft_service.tree_budget import TreeBudget
from draft_service.tree_plan import CANDIDATE_GRID, PROBE_EVERY, TreePlanner
from tests.draft_service.test_drafter import load_head

SESSIONS, STEPS = 6, 2 * PROBE_EVERY


def test_a_batch_of_online_sessions_plans_from_the_grid_and_bounds_its_host_work(monkeypatch):
    runtime = DraftRuntime(load_head(torch.device("cpu"), torch.float32), cuda_graphs=False)
    c = runtime.head.config
    generator = torch.Generator().manual_seed(0)
    features = lambda rows: torch.randn(rows, 3 * c.target_hidden_size, generator=generator)  # noqa: E731
    requests, chooses = [], []
    propose = runtime.drafter.propose_pending
    monkeypatch.setattr(runtime.drafter, "propose_pending", lambda batch: requests.append(batch) or propose(batch))
    choose = TreePlanner.choose
    monkeypatch.setattr(TreePlanner, "choose", lambda self, *a: chooses.append(self) or choose(self, *a))
    ids = [f"s{i}" for i in range(SESSIONS)]
    starts = []
    for i, sid in enumerate(ids):
        prompt = torch.randint(0, c.vocab_size, (20 + 10 * i,), generator=generator).tolist()
        starts.append(DraftStart(sid, prompt, features(len(prompt)), 1, DraftOptions("online", "24:0.0:5")))
    trees = runtime.step(DraftBatch(starts=starts, proposes=ids)).trees
    plans_per_step, observed_per_step = [len(chooses)], []
    for _ in range(STEPS):
        observed = sum(s.planner.observed_steps for s in runtime.sessions.values())
        # the target accepts each tree's first child, then a bonus token
        accepts = [DraftAccept(sid, [int(DraftTree.of(trees[sid]).tokens[1]), 2], features(2)) for sid in ids]
        trees = runtime.step(DraftBatch(accepts=accepts, proposes=ids)).trees
        plans_per_step.append(len(chooses) - sum(plans_per_step))
        observed_per_step.append(sum(s.planner.observed_steps for s in runtime.sessions.values()) - observed)
    allowed = {TreeBudget.parse("24:0.0:5"), *CANDIDATE_GRID, TreeBudget.parse("96:0.0:10")}
    for batch in requests:
        assert {r.budget for r in batch if r.plan[0].children == 10} <= allowed  # dynamic trees: the grid's or own
    # sessions started together re-plan in turn: about a quarter of the batch a step
    assert sum(plans_per_step[: REPLAN_EVERY]) == SESSIONS and max(plans_per_step) <= -(-SESSIONS // REPLAN_EVERY)
    # one probe in PROBE_EVERY proposals, by one session
    probes = [sum(r.budget == TreeBudget.parse("96:0.0:10") for r in batch) for batch in requests]
    assert [i for i, n in enumerate(probes) if n] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    assert max(probes) == 1
    # a step hands at most OBSERVED_PER_STEP sessions' trees to their planners (and the probe's)
    assert observed_per_step[1:] and max(observed_per_step) <= OBSERVED_PER_STEP + 1 and min(observed_per_step[1:]) > 0
